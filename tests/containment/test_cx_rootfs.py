"""Root writing anywhere in its own root filesystem (issue 24 item 1, D11): commands are granted
every filesystem right on / itself (no device nodes), so what must stay closed is closed by
mounts: /proc, /sys, /dev and /.dsec read-only, /dev/shm noexec. Attacks go through the new
freedom: names made directly in / (symlinks into /proc, hard links to the agent), renames of
the mount points, device nodes, and new top-level trees that must stay in their sandbox."""

from __future__ import annotations

import secrets
from pathlib import Path

from dsec.backends.container.spec import dsec_dir

from containment._util import py, sh

DENIED_FS = ("EROFS", "EACCES", "EPERM", "EBUSY", "EXDEV", "ETXTBSY")


async def test_root_with_slash_granted_cannot_write_proc_sys_dev_or_dsec(cx, server):
    """As root, with / writable: writes to /proc/1 and /proc/self knobs, /proc/sys, /sys, also
    through a symlink made in /; new entries in /dev and /.dsec; replacing /dev/null; a hard
    link to the agent binary; renaming /proc, /dev, /sys, /.dsec; device nodes anywhere;
    running code from /dev/shm: all fail. The host's /.dsec directory is unchanged."""
    sb = await cx.create_container(image="debian-python", user="root", labels={"role": "rootfs"})
    try:
        out = await py(sb, """
def write(p, data="1"):
    return attempt(lambda: open(p, "w").write(data))
OUT["symlink_made"] = attempt(os.symlink, "/proc", "/procl")      # allowed: a name in /
for p in ("/proc/1/oom_score_adj", "/proc/self/oom_score_adj", "/proc/self/comm", "/proc/1/coredump_filter",
          "/proc/sys/kernel/core_pattern", "/procl/1/oom_score_adj",
          "/sys/kernel/mm/ksm/run", "/.dsec/agent", "/.dsec/new", "/dev/new", "/dev/shm/../evil"):
    OUT["write " + p] = write(p)
OUT["mkdir /.dsec/d"] = attempt(os.mkdir, "/.dsec/d")
OUT["mkdir /dev/d"] = attempt(os.mkdir, "/dev/d")
OUT["symlink /dev/x"] = attempt(os.symlink, "/etc", "/dev/x")
OUT["unlink /dev/null"] = attempt(os.unlink, "/dev/null")
OUT["rename /dev/null"] = attempt(os.rename, "/tmp", "/dev/null")
OUT["link agent"] = attempt(os.link, "/.dsec/agent", "/agent-link")
for d in ("/proc", "/dev", "/sys", "/.dsec"):
    OUT["rename " + d] = attempt(os.rename, d, d + "-moved")
    OUT["rmdir " + d] = attempt(os.rmdir, d)
OUT["mknod /dev/m"] = attempt(os.mknod, "/dev/m", 0o20666, os.makedev(1, 1))
OUT["mknod /m"] = attempt(os.mknod, "/m", 0o20666, os.makedev(1, 1))
OUT["mknod /tmp/b"] = attempt(os.mknod, "/tmp/b", 0o60666, os.makedev(7, 0))
import shutil, subprocess
shutil.copy("/bin/true", "/dev/shm/t"); os.chmod("/dev/shm/t", 0o755)
OUT["exec /dev/shm"] = attempt(subprocess.run, ["/dev/shm/t"])
""")
        assert out.pop("symlink_made") == "ok", out
        assert not {k: v for k, v in out.items() if v not in DENIED_FS}, out
        r = await sh(sb, "test -c /dev/null && echo ok > /dev/null && ls -A /.dsec; "
                         "ls -A /dev | grep -c -e new -e '^d$' -e '^m$'; ls -A / | grep -c moved", user="root")
        assert r.stdout.split() == ["agent", "0", "0"], r
    finally:
        await sb.stop()
    host_dir = dsec_dir(server.paths.bin / "x")
    assert sorted(p.name for p in host_dir.iterdir()) == ["agent"]
    assert (host_dir / "agent").stat().st_size == 0 and (host_dir / "agent").stat().st_mode & 0o777 == 0o444


async def test_new_top_level_trees_stay_in_their_sandbox(cx, server):
    """A top-level directory and file root creates are in its own writable layer: a sandbox of
    the same image started before or after does not see them, nor does the host's /."""
    name = f"app-{secrets.token_hex(4)}"
    a = await cx.create_container(image="debian-python", user="root", labels={"role": "rootfs-a"})
    b = await cx.create_container(image="debian-python", user="root", labels={"role": "rootfs-b"})
    try:
        r = await sh(a, f"mkdir -p /{name}/sub && echo mine > /{name}/sub/f && touch /{name}.top && "
                        f"cat /{name}/sub/f", user="root")
        assert r.stdout == "mine\n", r
        c = await cx.create_container(image="debian-python", labels={"role": "rootfs-c"})   # after
        try:
            for other in (b, c):
                r = await sh(other, f"ls -d /{name} /{name}.top 2>&1 | grep -c 'No such file'", user="root")
                assert r.stdout == "2\n", r
        finally:
            await c.stop()
    finally:
        await a.stop()
        await b.stop()
    assert not any(p.name.startswith(name) for p in Path("/").iterdir())
