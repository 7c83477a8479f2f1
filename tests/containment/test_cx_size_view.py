"""Attacks on the sandbox's view of its own size (D50): lxcfs's files bound over /proc/meminfo,
/proc/cpuinfo, ... and the cpuset. Only those files of the lxcfs mount are reachable, read-only,
showing the reader's own cgroups; they cannot be unmounted, written, walked out of or widened."""

from __future__ import annotations

from dsec.backends.container.lxcfs import VIEW_FILES

from containment._util import DENIED, py


async def test_view_files_only_read_only_and_stuck(attacker):
    """Root looks for the lxcfs mount behind its /proc/meminfo: only the six view files are bound (no directory), read-only; open for writing, `..` from the file, openat(fd, "..") and name_to_handle_at/open_by_handle_at fail; umount2 of the binds is refused (EPERM); sched_setaffinity cannot widen the cpuset."""
    out = await py(attacker, r"""
views = []
for line in open("/proc/self/mountinfo"):
    left, _, right = line.partition(" - ")
    if right.split()[0].startswith("fuse"):
        f = left.split()
        views.append([f[3], f[4], f[5]])
OUT["views"] = views
OUT["write"] = attempt(os.open, "/proc/meminfo", os.O_WRONLY)
OUT["write_online"] = attempt(os.open, "/sys/devices/system/cpu/online", os.O_WRONLY)
OUT["dotdot"] = attempt(os.listdir, "/proc/meminfo/..")
OUT["umount"] = sc(166, b"/proc/meminfo", 2)                                   # umount2 MNT_DETACH
OUT["umount_online"] = sc(166, b"/sys/devices/system/cpu/online", 2)
fd = os.open("/proc/meminfo", os.O_RDONLY)
OUT["openat_parent"] = sc(257, fd, b"..", 0o200000)                            # openat(fd, "..", O_DIRECTORY)
OUT["openat_cgroup"] = sc(257, fd, b"../cgroup", 0o200000)
buf = ctypes.create_string_buffer(128 + 8)
ctypes.c_uint.from_buffer(buf).value = 128
OUT["name_to_handle"] = sc(303, fd, b"", ctypes.addressof(buf), ctypes.addressof(ctypes.create_string_buffer(4)), 0x1000)
OUT["open_by_handle"] = sc(304, fd, ctypes.addressof(buf), 0)
OUT["widen_affinity"] = attempt(os.sched_setaffinity, 0, set(range(os.cpu_count() or 1, 64)) | {0, 1})
OUT["affinity"] = sorted(os.sched_getaffinity(0))
OUT["meminfo"] = read("/proc/meminfo", 200)[:60]
""")
    # exactly the view files, each bound as itself (no directory of the lxcfs mount), read-only
    assert sorted(v[0] for v in out["views"]) == sorted("/" + f for f in VIEW_FILES), out["views"]
    assert all(v[0] == v[1] and v[2].split(",")[0] == "ro" for v in out["views"]), out["views"]
    assert out["write"] in DENIED + ("EROFS",) and out["write_online"] in DENIED + ("EROFS",), out
    assert out["dotdot"] == "ENOTDIR", out
    assert out["umount"] in DENIED and out["umount_online"] in DENIED, out
    assert out["openat_parent"] == "ENOTDIR" and out["openat_cgroup"] == "ENOTDIR", out
    assert out["name_to_handle"] != "ok" or out["open_by_handle"] in DENIED, out
    assert out["open_by_handle"] != "ok", out
    assert out["meminfo"].startswith("ok:MemTotal:"), out
    # the cpuset holds: a wider affinity is refused or cut back to the sandbox's own CPUs
    assert len(out["affinity"]) == 1, out


async def test_root_sees_only_its_own_figures(cx):
    """Root in one sandbox reads its own 300 MiB, not the other sandbox's or the host's, by every
    path that leads to the view files (/proc/self/root, /proc/thread-self/root)."""
    big = await cx.create_container(image="debian-python", memory_mb=900)
    small = await cx.create_container(image="debian-python", memory_mb=300)
    try:
        paths = ("/proc/meminfo", "/proc/self/root/proc/meminfo", "/proc/thread-self/root/proc/meminfo")
        for sb, mb in ((small, 300), (big, 900)):
            r = await sb.run("for p in " + " ".join(paths) + "; do head -1 $p; done", user="root")
            assert r.exit_code == 0 and r.stdout.split() == ["MemTotal:", str(mb << 10), "kB"] * 3, r
    finally:
        await big.stop()
        await small.stop()
