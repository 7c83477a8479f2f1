"""E2B's `user` account added to a sandbox's /etc/passwd and /etc/group (apiserver/e2b/layout.py):
before the entry that has id 1000 (getpwuid(1000) finds `user` first), the rest kept as it is."""

from __future__ import annotations

from dsec.apiserver.e2b.layout import with_group, with_user

DSEC = ("root:x:0:0:root:/root:/bin/bash\nsandbox:x:1000:1000:sandbox:/work:/bin/sh\n"
        "nobody:x:65534:65534::/nonexistent:/bin/false\n")


def test_user_goes_before_the_entry_of_uid_1000_with_its_shell():
    assert with_user(DSEC) == ("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/sh\n"
                               "sandbox:x:1000:1000:sandbox:/work:/bin/sh\nnobody:x:65534:65534::/nonexistent:/bin/false\n")
    assert with_group("root:x:0:\nsandbox:x:1000:\n") == "root:x:0:\nuser:x:1000:\nsandbox:x:1000:\n"


def test_without_uid_1000_it_is_appended_and_an_existing_user_is_kept():
    assert with_user("root:x:0:0::/root:/bin/sh") == "root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n"
    assert with_user(with_user(DSEC) or "") is None
    assert with_user("user:x:1001:1001::/home/user:/bin/sh\n") is None       # a `user` of its own: left alone
    assert with_group("root:x:0:\nuser:x:1000:\n") is None
    assert with_group("") == "user:x:1000:\n"
