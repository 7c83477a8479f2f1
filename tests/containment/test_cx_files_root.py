"""The files API of a root sandbox writes only where Landlock lets commands write: not in /proc,
/sys, /dev (except /dev/shm, /dev/mqueue) or /.dsec, and no file or removal directly in /
(a new top-level directory, with MKDIRS, is the one exception), also when reached through a symlink."""

from __future__ import annotations

import pytest

from dsec.types import DsecError

from containment._util import sh


@pytest.fixture
async def root_sb(cx):
    sb = await cx.create_container(image="busybox", user="root", labels={"role": "files-root"})
    yield sb
    await sb.stop()


async def refused(call, *args, **kw) -> str:
    with pytest.raises(DsecError) as ei:
        await call(*args, **kw)
    assert ei.value.status == 422, ei.value
    return ei.value.message


async def test_file_api_as_root_stays_out_of_landlock_denied_places(root_sb):
    """As root: replacing /dev/null, new entries in /dev, /.dsec, /proc, /sys or directly in /,
    removing top-level entries, and the same through a symlink into /dev, are all refused with
    EPERM and a reason; the places commands may write stay writable."""
    sb = root_sb
    r = await sh(sb, "mkdir -p /work/d && ln -s /dev /work/devlink && mkdir /work/empty && echo ok")
    assert r.stdout == "ok\n", r
    for path in ("/dev/null", "/dev/evil", "/work/devlink/evil", "/work/devlink/null", "/dev/pts/evil"):
        msg = await refused(sb.files.write, path, b"x")
        assert "/dev is off limits" in msg and "Operation not permitted" in msg, (path, msg)
    for path in ("/.dsec/agent", "/.dsec/evil"):
        assert "/.dsec is off limits" in await refused(sb.files.write, path, b"x"), path
    assert "/proc is off limits" in await refused(sb.files.write, "/proc/sys/kernel/hostname", b"evil")
    assert "/sys is off limits" in await refused(sb.files.write, "/sys/kernel/evil", b"x")
    assert "directly in /" in await refused(sb.files.write, "/top-level.txt", b"x")
    assert "directly in /" in await refused(sb.files.write, "/bin", b"x")     # replacing a top entry
    assert "directly in /" in await refused(sb.files.remove, "/tmp")
    assert "/dev is off limits" in await refused(sb.files.remove, "/dev/null")
    assert "/dev is off limits" in await refused(sb.files.remove, "/work/devlink/zero")
    for path in ("/dev/evil-dir/f", "/proc/evil-dir/f", "/.dsec/evil-dir/f", "/dev/shm/../evil-dir/f"):
        assert "off limits" in await refused(sb.files.write, path, b"x", mkdirs=True), path
    r = await sh(sb, "test -c /dev/null && test -c /dev/zero && echo devices-intact; "
                     "ls -A /dev | grep -c evil; ls -A /.dsec; test -e /top-level.txt || echo no-top")
    assert r.stdout == "devices-intact\n0\nagent\nno-top\n", r
    # what commands may write, the files API writes: /dev/shm, the workdir, a new top-level dir
    await sb.files.write("/dev/shm/ok", b"shm")
    await sb.files.write("/work/d/ok", b"work")
    await sb.files.write("/newtop/sub/f", b"top", mkdirs=True)
    await sb.files.remove("/work/empty")
    r = await sh(sb, "cat /dev/shm/ok /work/d/ok /newtop/sub/f; test -e /work/empty || echo removed; "
                     "echo cmd > /newtop/by-cmd && echo written")
    assert r.stdout == "shmworktopremoved\nwritten\n", r
