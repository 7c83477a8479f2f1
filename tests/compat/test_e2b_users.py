"""E2B's user layout and file calls as any user (issue 24, items 3 and 4), with the stock e2b SDK
against a real server: sandboxes created through the E2B mount have the default user `user`
(uid 1000) whose home /home/user is the cwd and HOME of commands; every file call acts as the
user it names (its permissions, its ids on what it creates), root only where the project's
policy allows it (allow_root)."""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.iam import IAM

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException
from e2b.sandbox.filesystem.filesystem import WriteEntry

TEMPLATE = "debian-python"


@pytest.fixture(scope="module")
def sbx(e2b_env):
    s = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": "e2b-users"})
    yield s
    s.kill()


def sh(sbx, cmd: str, **kw) -> str:
    return sbx.commands.run(cmd, **kw).stdout


def test_default_user_is_user_with_home_slash_home_slash_user(sbx):
    """whoami, pwd, $HOME, ~'s owner: E2B's layout; `sandbox` (dsec's name of uid 1000) still
    resolves; root is reached with user='root' and is at home in /root."""
    assert sh(sbx, "whoami; pwd; echo $HOME; id -u; id -g; id -gn") == "user\n/home/user\n/home/user\n1000\n1000\nuser\n"
    assert sh(sbx, "stat -c '%U:%G %u:%g %a' /home/user") == "user:user 1000:1000 755\n"
    assert sh(sbx, "id -u sandbox; getent passwd user") == "1000\nuser:x:1000:1000::/home/user:/bin/bash\n"
    assert sh(sbx, "python3 -c 'import getpass, os; print(getpass.getuser(), os.path.expanduser(\"~\"))'") \
        == "user /home/user\n"
    assert sh(sbx, "whoami; echo $HOME", user="root") == "root\n/root\n"
    assert sh(sbx, "pwd", cwd="/tmp") == "/tmp\n"


def test_relative_paths_land_in_the_users_home(sbx):
    sbx.files.write("rel/notes.txt", "relative")
    assert sh(sbx, "cat /home/user/rel/notes.txt; stat -c %u:%g /home/user/rel/notes.txt") == "relative1000:1000\n"
    assert sbx.files.read("rel/notes.txt") == "relative"
    assert [e.path for e in sbx.files.list("rel")] == ["/home/user/rel/notes.txt"]
    assert sh(sbx, "cat rel/notes.txt") == "relative"          # commands start in the home too


def test_files_as_root_and_as_user(sbx):
    """files.write/read/list/exists/remove/write_files with user=: the named user's permissions
    and ids; root's files are root's own, and the default user is refused them."""
    sbx.files.write("/root/x", "secret", user="root")
    assert sbx.files.read("/root/x", user="root") == "secret"
    assert sh(sbx, "stat -c '%u:%g %a' /root/x", user="root") == "0:0 644\n"
    with pytest.raises(SandboxException, match="(?i)permission denied"):
        sbx.files.read("/root/x")
    with pytest.raises(SandboxException, match="(?i)permission denied"):
        sbx.files.read("/root/x", user="user")
    with pytest.raises(SandboxException, match="(?i)permission denied"):
        sbx.files.write("/root/y", "no")
    with pytest.raises(SandboxException, match="(?i)permission denied"):
        sbx.files.list("/root")
    assert "x" in [e.name for e in sbx.files.list("/root", user="root")]
    assert sbx.files.exists("/root/x", user="root")
    sbx.files.write_files([WriteEntry(path="/root/w1", data="1"), WriteEntry(path="/root/d/w2", data="2")], user="root")
    assert sh(sbx, "cat /root/w1 /root/d/w2; stat -c %u /root/d /root/d/w2", user="root") == "120\n0\n"
    sbx.files.remove("/root/x", user="root")
    sbx.files.remove("/root/d", user="root")
    assert not sbx.files.exists("/root/x", user="root")
    # as the default user by name: uid 1000's ids on what it creates
    sbx.files.write("/tmp/by-user", "u", user="user")
    sbx.files.write("/tmp/by-default", "d")
    assert sh(sbx, "stat -c '%U:%G' /tmp/by-user /tmp/by-default") == "user:user\nuser:user\n"
    # dsec's own name of uid 1000 and numeric ids work as well
    sbx.files.write("/tmp/by-uid", "n", user="4242:4343")
    assert sh(sbx, "stat -c %u:%g /tmp/by-uid") == "4242:4343\n"


def test_any_user_of_the_image_by_name(sbx):
    """A user the image (or a command) made: file calls and commands act as that user's ids."""
    sh(sbx, "useradd -m -u 1234 alice", user="root")
    sbx.files.write("/home/alice/notes", "mine", user="alice")
    assert sh(sbx, "stat -c '%U:%G %u' /home/alice/notes") == "alice:alice 1234\n"
    assert sbx.files.read("/home/alice/notes", user="alice") == "mine"
    assert sh(sbx, "id -un; id -u", user="alice") == "alice\n1234\n"
    sbx.files.write("/tmp/private", "p", user="alice")
    sh(sbx, "chmod 600 /tmp/private", user="alice")
    with pytest.raises(SandboxException, match="(?i)permission denied"):
        sbx.files.read("/tmp/private")                          # not the default user's


def test_a_user_that_does_not_exist_is_refused_naming_it(sbx):
    with pytest.raises(InvalidArgumentException, match="no-such-user"):
        sbx.files.write("/tmp/z", "z", user="no-such-user")
    with pytest.raises(InvalidArgumentException, match="no-such-user"):
        sbx.files.read("/tmp/by-user", user="no-such-user")


def test_root_file_calls_need_allow_root(server, e2b_env):
    """A project whose policy forbids root: file calls as root are refused naming allow_root,
    those of the default user work."""
    with IAM(server.paths.iam_db) as iam:
        project = iam.create_project(f"e2b-noroot-{os.urandom(3).hex()}", iam.root().id)
        key = iam.create_key(project.id)

    async def forbid() -> None:
        async with server.client() as admin:
            await admin.set_policy(project.id, {"allow_root": False})
    asyncio.run(forbid())
    s = Sandbox.create(TEMPLATE, timeout=120, api_key=key)
    try:
        s.files.write("/tmp/mine", "ok")
        assert s.files.read("/tmp/mine") == "ok"
        for call in (lambda: s.files.write("/root/x", "x", user="root"), lambda: s.files.read("/etc/hostname", user="root"),
                     lambda: s.files.list("/root", user="root"), lambda: s.files.remove("/tmp/mine", user="root")):
            with pytest.raises(SandboxException, match="allow_root"):
                call()
        assert s.files.exists("/tmp/mine")
    finally:
        s.kill()


def test_a_vm_sandbox_has_the_layout_too(vm_client, e2b_env):
    """The account is added through the guest's agent as well (busybox: uid 1000 is `sandbox`)."""
    s = Sandbox.create("busybox", timeout=120, metadata={"dsec.backend": "microvm"})
    try:
        assert sh(s, "whoami; pwd; echo $HOME; stat -c %U:%G /home/user") == "user\n/home/user\n/home/user\nuser:user\n"
        s.files.write("/root/vm", "r", user="root")
        assert sh(s, "stat -c %u:%g /root/vm", user="root") == "0:0\n"
    finally:
        s.kill()
