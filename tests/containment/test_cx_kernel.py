"""Attacks on the kernel and on the container's boundaries, from root (and the default user) inside.

Each attack makes the raw system calls itself (python3 + ctypes, x86-64 syscall numbers), so
neither a missing tool nor libc hides what the kernel answered.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


from dsec.types import ContainerArgs

from containment._util import DENIED, py, sh


async def test_mount_and_new_mount_api(attacker):
    """mount(2) (tmpfs, bind of /, proc, remount), umount of masked paths and the new mount API (fsopen, open_tree, move_mount, mount_setattr) all fail with EPERM."""
    out = await py(attacker, """
OUT["tmpfs"] = sc(165, b"none", b"/mnt", b"tmpfs", 0, 0)
OUT["bind_root"] = sc(165, b"/", b"/mnt", 0, 0x1000 | 0x4000, 0)          # MS_BIND|MS_REC
OUT["proc"] = sc(165, b"proc", b"/mnt", b"proc", 0, 0)
OUT["remount_sys_rw"] = sc(165, 0, b"/sys", 0, 0x20, 0)                  # MS_REMOUNT
OUT["umount_masked"] = sc(166, b"/proc/kcore" if os.path.exists("/proc/kcore") else b"/proc/keys", 2)
OUT["umount_proc_sys"] = sc(166, b"/proc/sys", 2)
OUT["fsopen"] = sc(430, b"tmpfs", 0)
OUT["open_tree"] = sc(428, -100, b"/", 1)                                # OPEN_TREE_CLONE
OUT["move_mount"] = sc(429, -100, b"/tmp", -100, b"/mnt", 0)
OUT["mount_setattr"] = sc(442, -100, b"/", 0, 0, 0)
""")
    assert set(out.values()) == {"EPERM"}, out
    r = await sh(attacker, "for c in 'mount -t tmpfs none /mnt' 'mount --bind / /mnt' 'umount -l /proc/keys' "
                           "'mount -o remount,rw /sys'; do $c >/dev/null 2>&1; echo rc=$?; done")
    assert "rc=0" not in r.stdout and r.stdout.count("rc=") == 4, r


async def test_unshare_and_clone_new_namespaces(attacker):
    """unshare(2) and clone(2) with every namespace flag (user ns included: no privilege needed elsewhere) fail with EPERM for root and the user; clone3 answers ENOSYS."""
    flags = {"user": 0x10000000, "mnt": 0x20000, "pid": 0x20000000, "net": 0x40000000, "uts": 0x04000000,
             "ipc": 0x08000000, "cgroup": 0x02000000, "time": 0x80}
    for user in ("root", None):
        out = await py(attacker, f"""
for name, flag in {flags!r}.items():
    OUT["unshare_" + name] = sc(272, flag)
    OUT["clone_" + name] = sc(56, flag | 17, 0, 0, 0, 0)      # SIGCHLD; a child would exit at once
OUT["clone3"] = sc(435, 0, 0)
""", user=user)
        clone3 = out.pop("clone3")
        assert set(out.values()) == {"EPERM"}, (user, out)
        assert clone3 == "ENOSYS", clone3
    r = await sh(attacker, "unshare -Ur id 2>&1; unshare -m true 2>&1; echo rc=$?", user=None)
    assert "uid=0" not in r.stdout and "rc=1" in r.stdout, r


async def test_setns_into_agent_and_own_namespaces(attacker):
    """setns(2) into the agent's or the command's own namespaces fails: /proc/1/ns/* cannot even be opened (Landlock ptrace scope), setns answers EPERM."""
    out = await py(attacker, """
for ns in ("mnt", "pid", "net", "uts", "ipc", "user", "cgroup"):
    try:
        fd = os.open(f"/proc/1/ns/{ns}", os.O_RDONLY)
        OUT["agent_" + ns] = "opened:" + sc(308, fd, 0)
    except OSError as e:
        OUT["agent_" + ns] = errno.errorcode[e.errno]
    try:
        fd = os.open(f"/proc/self/ns/{ns}", os.O_RDONLY)
        OUT["self_" + ns] = sc(308, fd, 0)
    except OSError as e:
        OUT["self_" + ns] = errno.errorcode[e.errno]
""")
    assert all(v in ("EACCES", "opened:EPERM") for k, v in out.items() if k.startswith("agent_")), out
    assert all(v == "EPERM" for k, v in out.items() if k.startswith("self_")), out


async def test_kernel_keyring(attacker):
    """Kernel keyring calls (add_key, request_key, keyctl: get/join session keyring) fail with EPERM and /proc/keys shows nothing."""
    out = await py(attacker, """
OUT["add_key"] = sc(248, b"user", b"dsec-attack", b"secret", 6, (-3) & 0xFFFFFFFF)
OUT["request_key"] = sc(249, b"user", b"dsec-attack", 0, 0)
OUT["keyctl_get"] = sc(250, 0, (-3) & 0xFFFFFFFF, 1)
OUT["keyctl_join"] = sc(250, 1, 0)
OUT["proc_keys"] = read("/proc/keys")
""")
    keys = out.pop("proc_keys")
    assert set(out.values()) == {"EPERM"}, out
    assert keys in ("ok:", "ENOENT", "EACCES"), keys


async def test_bpf_syscall(attacker):
    """bpf(2) (map create, program load, pinned object get) fails with EPERM: the sandbox can neither load programs nor touch the network-policy maps."""
    out = await py(attacker, """
import struct
attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1) + b"\\0" * 112)   # BPF_MAP_TYPE_ARRAY
OUT["map_create"] = sc(321, 0, attr, 128)
OUT["prog_load"] = sc(321, 5, ctypes.create_string_buffer(128), 128)
path = ctypes.create_string_buffer(b"/sys/fs/bpf/x")
OUT["obj_get"] = sc(321, 7, ctypes.create_string_buffer(struct.pack("Q", ctypes.addressof(path)) + b"\\0" * 120), 128)
OUT["prog_get_next_id"] = sc(321, 11, ctypes.create_string_buffer(128), 128)
""")
    assert set(out.values()) == {"EPERM"}, out


async def test_perf_event_open(attacker):
    """perf_event_open(2) (software CPU clock on self, and system-wide on CPU 0) fails with EPERM."""
    out = await py(attacker, """
import struct
attr = ctypes.create_string_buffer(struct.pack("IIQ", 1, 128, 0) + b"\\0" * 112)   # PERF_TYPE_SOFTWARE, CPU_CLOCK
OUT["self"] = sc(298, attr, 0, -1, -1, 0)
OUT["cpu0"] = sc(298, attr, -1, 0, -1, 0)
OUT["tracepoint"] = sc(298, ctypes.create_string_buffer(struct.pack("IIQ", 2, 128, 1) + b"\\0" * 112), -1, 0, -1, 0)
""")
    assert set(out.values()) == {"EPERM"}, out


async def test_kernel_module_load(attacker):
    """Loading or removing kernel modules (init_module, finit_module, delete_module) fails with EPERM; kernel.modprobe cannot be redirected."""
    out = await py(attacker, """
OUT["init_module"] = sc(175, ctypes.create_string_buffer(64), 64, b"")
fd = os.open("/usr/bin/true", os.O_RDONLY)
OUT["finit_module"] = sc(313, fd, b"", 0)
OUT["delete_module"] = sc(176, b"ext4", 0)
OUT["kexec_load"] = sc(246, 0, 0, 0, 0)
""")
    assert set(out.values()) == {"EPERM"}, out
    r = await sh(attacker, "echo /tmp/pwn > /proc/sys/kernel/modprobe 2>&1; echo rc=$?")
    assert "rc=1" in r.stdout, r


IOCTLS = {"XFS_IOC_SWAPEXT": 0xC0C0586D, "EXT4_IOC_MOVE_EXT": 0xC028660F, "FS_IOC_SETFLAGS": 0x40086602,
          "FIFREEZE": 0xC0045877, "TIOCSTI": 0x5412}


async def test_swap_extent_and_freeze_ioctls_incl_high_bits(attacker):
    """XFS_IOC_SWAPEXT, EXT4_IOC_MOVE_EXT, FS_IOC_SETFLAGS, FIFREEZE and TIOCSTI fail with EPERM (seccomp), also with high bits set in the 64-bit request number (the kernel ignores them)."""
    out = await py(attacker, f"""
with open("/work/a", "wb") as f:
    f.write(b"a" * 8192)
fds = {{"file": os.open("/work/a", os.O_RDWR), "root": os.open("/", os.O_RDONLY)}}
buf = ctypes.create_string_buffer(4096)
for name, code in {IOCTLS!r}.items():
    for where, fd in fds.items():
        for hi in (0, 0xdead000000000000, 0xFFFFFFFF00000000, 0x100000000):
            OUT[f"{{name}}/{{where}}/{{hi:#x}}"] = sc(16, fd, code | hi, buf)
""")
    assert set(out.values()) == {"EPERM"}, {k: v for k, v in out.items() if v != "EPERM"}


async def test_io_uring(attacker):
    """io_uring_setup/enter/register fail with EPERM (io_uring bypasses seccomp for the calls it performs)."""
    out = await py(attacker, """
OUT["setup"] = sc(425, 8, ctypes.create_string_buffer(120))
OUT["enter"] = sc(426, 0, 1, 0, 0, 0, 0)
OUT["register"] = sc(427, 0, 0, 0, 0)
""")
    assert set(out.values()) == {"EPERM"}, out


async def test_userfaultfd(attacker):
    """userfaultfd(2) (kernel and user-mode-only) fails with EPERM and /dev/userfaultfd does not exist."""
    for user in ("root", None):
        out = await py(attacker, """
OUT["uffd"] = sc(323, 0)
OUT["uffd_user_only"] = sc(323, 1)
OUT["dev"] = read("/dev/userfaultfd")
""", user=user)
        assert out == {"uffd": "EPERM", "uffd_user_only": "EPERM", "dev": "ENOENT"}, out


async def test_chroot_and_pivot_root(attacker):
    """chroot(2) and pivot_root(2) fail with EPERM (the classic chroot escape needs them)."""
    out = await py(attacker, """
os.makedirs("/tmp/jail/old", exist_ok=True)
OUT["chroot_tmp"] = sc(161, b"/tmp/jail")
OUT["chroot_root"] = sc(161, b"/")
OUT["pivot_root"] = sc(155, b"/tmp/jail", b"/tmp/jail/old")
""")
    assert set(out.values()) == {"EPERM"}, out


async def test_raise_rlimits(attacker):
    """Raising hard rlimits (NOFILE, CORE) fails with EPERM even for root (no CAP_SYS_RESOURCE), NOFILE is the sandbox's `nofile`, and the default user cannot change the agent's limits."""
    out = await py(attacker, """
import resource
class RL(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
def raise_hard(res):
    old = RL()
    libc.prlimit64(0, res, None, ctypes.byref(old))
    if old.max == 0xFFFFFFFFFFFFFFFF:
        return "unlimited"
    new = RL(old.max + 1, old.max + 1)
    r = libc.prlimit64(0, res, ctypes.byref(new), None)
    return "ok" if r == 0 else errno.errorcode[ctypes.get_errno()]
OUT["nofile"] = raise_hard(resource.RLIMIT_NOFILE)
OUT["core"] = raise_hard(resource.RLIMIT_CORE)
OUT["nofile_hard"] = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
""")
    assert out["nofile"] == "EPERM" and out["core"] == "EPERM", out
    if "nofile" in ContainerArgs.model_fields:
        assert out["nofile_hard"] == ContainerArgs.model_fields["nofile"].default, out
    out = await py(attacker, """
class RL(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
new = RL(8, 8)
r = libc.prlimit64(1, 7, ctypes.byref(new), None)            # shrink the agent's NOFILE
OUT["agent"] = "ok" if r == 0 else errno.errorcode[ctypes.get_errno()]
""", user=None)
    assert out["agent"] == "EPERM", out
    assert (await sh(attacker, "echo still-fine")).stdout == "still-fine\n"


async def test_time_change(attacker):
    """Setting the clock (settimeofday, clock_settime, adjtimex, clock_adjtime, `date -s`) fails with EPERM; the host clock does not move (checked after every attack)."""
    out = await py(attacker, """
import struct
now = time.time()
tv = ctypes.create_string_buffer(struct.pack("qq", int(now), 0))
OUT["settimeofday"] = sc(164, tv, 0)
OUT["clock_settime"] = sc(227, 0, tv)
tx = ctypes.create_string_buffer(struct.pack("I", 1) + b"\\0" * 204)          # modes = ADJ_OFFSET, offset 0
OUT["adjtimex"] = sc(159, tx)
OUT["clock_adjtime"] = sc(305, 0, tx)
""")
    assert set(out.values()) == {"EPERM"}, out
    r = await sh(attacker, "date -s '2001-01-01 00:00:00' 2>&1; echo rc=$?")
    assert "rc=1" in r.stdout, r


async def test_hostname_change(attacker):
    """sethostname/setdomainname, `hostname x` and writes to /proc/sys/kernel/hostname fail; the sandbox stays 'sandbox', the host and the neighbour keep theirs."""
    out = await py(attacker, """
OUT["sethostname"] = sc(170, b"pwned", 5)
OUT["setdomainname"] = sc(171, b"pwned", 5)
OUT["proc"] = attempt(lambda: open("/proc/sys/kernel/hostname", "w").write("pwned"))
""")
    assert out["sethostname"] == "EPERM" and out["setdomainname"] == "EPERM", out
    assert out["proc"] in ("EROFS", "EACCES", "EPERM"), out
    r = await sh(attacker, "hostname pwned >/dev/null 2>&1; cat /proc/sys/kernel/hostname")
    assert r.stdout == "sandbox\n", r
    assert socket.gethostname() != "pwned"


async def test_devices_mem_kmsg_block_mknod(attacker):
    """Host devices are absent (/dev/mem, /dev/kmsg, disks, kvm, vsock, fuse, tun, loop) and mknod of char/block devices fails (no CAP_MKNOD, Landlock, device cgroup)."""
    out = await py(attacker, """
OUT["dev"] = sorted(os.listdir("/dev"))
for d in ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/dev/vda", "/dev/sda", "/dev/nvme0n1",
          "/dev/kvm", "/dev/vsock", "/dev/fuse", "/dev/net/tun", "/dev/loop-control", "/dev/loop0",
          "/dev/console", "/dev/dri"):
    OUT[d] = read(d, 16)
OUT["mknod_mem"] = sc(133, b"/tmp/mem", 0o20600, (1 << 8) | 1)
OUT["mknod_kmsg_in_dev"] = sc(133, b"/dev/kmsg2", 0o20600, (1 << 8) | 11)
OUT["mknod_block"] = sc(133, b"/tmp/vda", 0o60600, (254 << 8) | 0)
OUT["mknodat_block"] = sc(259, -100, b"/work/sda", 0o60600, (8 << 8) | 0)
""")
    allowed = {"core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
               "stdout", "tty", "urandom", "zero"}
    assert set(out.pop("dev")) <= allowed
    assert all(v == "ENOENT" for k, v in out.items() if k.startswith("/dev/")), out
    assert all(v in DENIED for k, v in out.items() if k.startswith("mknod") and "in_dev" not in k), out
    assert out["mknod_kmsg_in_dev"] in (*DENIED, "EROFS"), out       # /dev is a read-only mount (D11)


async def test_setuid_binaries_give_no_privilege(attacker):
    """A setuid-root binary (made by root inside, or su from the image) run by the default user does not gain root: no_new_privs is set for every command."""
    r = await sh(attacker, "cp /usr/bin/id /tmp/suid-id && cp /usr/bin/python3 /tmp/suid-py && "
                           "chmod 4755 /tmp/suid-id /tmp/suid-py && ls -l /tmp/suid-id")
    assert r.stdout.startswith("-rwsr-xr-x"), r
    r = await sh(attacker, "grep NoNewPrivs /proc/self/status; /tmp/suid-id -u; "
                           "PYTHONHOME=/usr /tmp/suid-py -c 'import os; print(os.geteuid(), os.getuid())'; "
                           "su -c id root </dev/null 2>&1; echo su=$?", user=None)
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NoNewPrivs:", "1"], r
    assert lines[1] == "1000" and lines[2] == "1000 1000", r
    assert "uid=0" not in r.stdout and "su=0" not in r.stdout, r


async def test_cgroup_escape_and_release_agent(attacker):
    """Escaping the cgroup (write to /sys/fs/cgroup, mount a v1 hierarchy to set release_agent, cgroup namespace) fails; the host's release_agent files are unchanged."""
    root = Path("/sys/fs/cgroup")
    agents = {p: p.read_text() for p in root.glob("*/release_agent")}
    out = await py(attacker, """
OUT["ls"] = sorted(os.listdir("/sys/fs/cgroup")) if os.path.isdir("/sys/fs/cgroup") else "ENOENT"
OUT["mkdir"] = attempt(os.mkdir, "/sys/fs/cgroup/pwn")
OUT["write"] = attempt(lambda: open("/sys/fs/cgroup/release_agent", "w").write("/tmp/x"))
OUT["mount_v1"] = sc(165, b"cgroup", b"/mnt", b"cgroup", 0, b"rdma,release_agent=/tmp/x")
OUT["mount_v2"] = sc(165, b"cgroup2", b"/mnt", b"cgroup2", 0, 0)
OUT["unshare_cgroup"] = sc(272, 0x02000000)
""")
    assert out.pop("ls") in ([], "ENOENT"), out
    assert out["mkdir"] in ("EROFS", "EACCES", "EPERM", "ENOENT") and out["write"] in ("EROFS", "EACCES", "EPERM", "ENOENT"), out
    assert out["mount_v1"] == out["mount_v2"] == out["unshare_cgroup"] == "EPERM", out
    assert {p: p.read_text() for p in root.glob("*/release_agent")} == agents


async def test_sysctl_and_core_pattern(attacker):
    """Writing sysctls (kernel.core_pattern pipe escape, vm.drop_caches, kernel.sysrq) and /proc/sysrq-trigger fails; the host's values are unchanged."""
    host = {p: Path(p).read_text() for p in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/sysrq")
            if Path(p).exists()}
    out = await py(attacker, """
for p, v in (("/proc/sys/kernel/core_pattern", "|/tmp/pwn %p"), ("/proc/sys/vm/drop_caches", "3"),
             ("/proc/sys/kernel/sysrq", "1"), ("/proc/sysrq-trigger", "h")):
    OUT[p] = attempt(lambda: open(p, "w").write(v))
""")
    assert all(v in ("EROFS", "EACCES", "EPERM", "ENOENT") for v in out.values()), out
    assert {p: Path(p).read_text() for p in host} == host


async def test_kernel_info_leaks(attacker):
    """Kernel information is not disclosed: dmesg/syslog fail, /proc/kallsyms shows only zero addresses, /proc/kcore, sched_debug, timer_list, /sys/kernel/debug are absent or empty."""
    out = await py(attacker, """
OUT["syslog"] = sc(103, 3, ctypes.create_string_buffer(4096), 4096)
OUT["kmsg"] = read("/dev/kmsg", 64)
addrs = set()
if os.path.exists("/proc/kallsyms"):
    with open("/proc/kallsyms") as f:
        for i, line in enumerate(f):
            addrs.add(line.split()[0])
            if i > 20000:
                break
OUT["kallsyms_addrs"] = sorted(addrs)[:5] or ["0000000000000000"]
for p in ("/proc/kcore", "/proc/sched_debug", "/proc/timer_list", "/proc/kpagecgroup", "/proc/keys"):
    OUT[p] = read(p, 64)
OUT["debugfs"] = os.listdir("/sys/kernel/debug") if os.path.isdir("/sys/kernel/debug") else []
""")
    assert out["syslog"] == "EPERM" and out["kmsg"] == "ENOENT", out
    assert out["kallsyms_addrs"] == ["0000000000000000"], out["kallsyms_addrs"]
    assert all(out[p] in ("ok:", "ENOENT", "EACCES") for p in
               ("/proc/kcore", "/proc/sched_debug", "/proc/timer_list", "/proc/kpagecgroup", "/proc/keys")), out
    assert out["debugfs"] == [], out
    r = await sh(attacker, "dmesg 2>&1 | head -2; echo rc=$?")
    assert "not permitted" in r.stdout, r


async def test_signals_cannot_reach_outside(client, server, neighbour):
    """Signals from root inside (kill -9 -1, kill of host pids: the server, the neighbour's agent) reach only the sandbox's own processes; pid 1 survives and the sandbox still works."""
    sb = await client.create_container(image="debian-python", user="root")
    try:
        server_pid = server.proc.pid
        nb_agent = int((server.paths.sandboxes / neighbour.sb.id / "run" / "pid").read_text())
        inside = (await sh(sb, "ls /proc | grep -E '^[0-9]+$' | tr '\\n' ' '")).stdout.split()
        targets = [p for p in (server_pid, nb_agent, os.getpid()) if str(p) not in inside]
        assert targets
        out = await py(sb, f"""
for pid in {targets!r}:
    OUT[str(pid)] = attempt(os.kill, pid, 0)
    OUT["pidfd_" + str(pid)] = sc(434, pid, 0)
""")
        assert set(out.values()) == {"ESRCH"}, out
        await sh(sb, "sleep 1000 >/dev/null 2>&1 & kill -9 -1; kill -KILL 1; kill -STOP 1; sleep 0.2; echo done",
                 timeout_s=30)
        assert (await sh(sb, "echo alive")).stdout == "alive\n"
        assert server.proc.poll() is None
        os.kill(nb_agent, 0)
    finally:
        await sb.stop()
    # the default user cannot signal the agent at all
    async with await client.create_container(image="busybox") as sb2:
        r = await sh(sb2, "kill -TERM 1 2>&1; echo rc=$?", user=None)
        assert "rc=1" in r.stdout, r
        assert (await sh(sb2, "echo alive")).stdout == "alive\n"
