"""Docker's root (issue 24 item 1) through the stock e2b SDK: a task's solution run as root
makes top-level directories and files, as in Docker, while the kernel's and dsec's own mounts stay
read-only (tests/containment/test_cx_rootfs.py attacks them further)."""

from __future__ import annotations

import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import CommandExitException, Sandbox


def test_root_writes_anywhere_but_kernel_mounts_stay_read_only(e2b_env):
    sbx = Sandbox.create("debian-python", timeout=120)
    try:
        r = sbx.commands.run("mkdir -p /app && echo x > /app/f && cat /app/f && touch /x /usr/local/bin/y "
                             "&& rm -rf /app /x && echo done", user="root")
        assert r.stdout == "x\ndone\n", r
        sbx.files.write("/data/in.txt", "from the SDK", user="root")        # a new top-level dir
        assert sbx.commands.run("cat /data/in.txt", user="root").stdout == "from the SDK"
        for attack in ("mknod /dev/foo c 1 3", "echo 1 > /proc/sys/kernel/sysrq", "touch /sys/x",
                       "touch /.dsec/x", "echo -1000 > /proc/1/oom_score_adj"):
            with pytest.raises(CommandExitException):
                sbx.commands.run(attack, user="root")
    finally:
        sbx.kill()
