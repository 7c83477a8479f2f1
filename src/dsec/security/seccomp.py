"""The default seccomp profile of every container sandbox (OCI `linux.seccomp`), as data.

A deny-list on top of an allow-by-default action: agents run arbitrary build tools, so an
allow-list would break them; the denied calls are those no task needs and that attack the
kernel or escape the sandbox. Denied calls fail with EPERM (ENOSYS for clone3, so libc falls
back to clone, whose namespace flags we can inspect).
"""

from __future__ import annotations

import errno

# Calls no sandboxed task needs: kernel/module/boot control, other mount namespaces and
# filesystems, kernel keyrings, BPF and perf (kernel attack surface), time changes that
# would leak to the host clock, swap, accounting, handle-based opens (escape via
# open_by_handle_at), userfaultfd and io_uring (favourite exploit primitives).
DENIED_SYSCALLS: tuple[str, ...] = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "settimeofday", "stime", "adjtimex",
    "create_module", "delete_module", "finit_module", "init_module", "get_kernel_syms", "query_module",
    "kexec_file_load", "kexec_load", "reboot", "keyctl", "request_key", "lookup_dcookie",
    "mount", "umount", "umount2", "mount_setattr", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "pivot_root", "chroot", "setns", "unshare",
    "name_to_handle_at", "open_by_handle_at", "nfsservctl", "perf_event_open", "quotactl", "quotactl_fd",
    "swapon", "swapoff", "syslog", "uselib", "userfaultfd", "vhangup", "iopl", "ioperm",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "fanotify_init", "kcmp", "process_vm_readv", "process_vm_writev",
    "vm86", "vm86old", "lsm_set_self_attr",
)

# ioctl request numbers (matched on the low 32 bits: a plain EQ on the 64-bit argument is
# bypassed by setting high bits, see host-facts).
DENIED_IOCTLS: dict[str, int] = {
    "XFS_IOC_SWAPEXT": 0xC0C0586D,       # swaps extents between files: corrupted XFS in the reference
    "EXT4_IOC_MOVE_EXT": 0xC028660F,     # the ext4 twin
    "TIOCSTI": 0x5412,                   # fake terminal input into another process's tty
    "TIOCLINUX": 0x541C,
    "FS_IOC_SETFLAGS": 0x40086602,       # chattr +i/+a games on the writable layer
    "FIFREEZE": 0xC0045877,
    "FITHAW": 0xC0045878,
}

# clone(2) flags that create namespaces; user namespaces need no privilege, so block them here.
NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080,
}

# socket(2) families no task needs. AF_VSOCK reaches the hypervisor of a VM node whatever the
# network policy says (cgroup-BPF sees only IP sockets); the others are rarely-used kernel code.
DENIED_SOCKET_FAMILIES: dict[str, int] = {
    "AF_KEY": 15, "AF_RDS": 21, "AF_LLC": 26, "AF_CAN": 29, "AF_TIPC": 30, "AF_BLUETOOTH": 31,
    "AF_PHONET": 35, "AF_IEEE802154": 36, "AF_ALG": 38, "AF_NFC": 39, "AF_VSOCK": 40, "AF_KCM": 41,
    "AF_QIPCRTR": 42, "AF_SMC": 43, "AF_XDP": 44, "AF_MCTP": 45,
}

LOW32 = 0xFFFFFFFF
AGENT_PID = 1          # the agent is the container's init


def seccomp_profile() -> dict:
    """The OCI linux.seccomp section."""
    eperm = errno.EPERM
    rules: list[dict] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": eperm},
        # clone3 passes flags in a struct seccomp cannot read: make libc fall back to clone
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    for code in DENIED_IOCTLS.values():
        rules.append({"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": eperm,
                      "args": [{"index": 1, "value": LOW32, "valueTwo": code, "op": "SCMP_CMP_MASKED_EQ"}]})
    for family in DENIED_SOCKET_FAMILIES.values():
        for call in ("socket", "socketpair"):
            rules.append({"names": [call], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EAFNOSUPPORT,
                          "args": [{"index": 0, "value": LOW32, "valueTwo": family, "op": "SCMP_CMP_MASKED_EQ"}]})
    # prlimit64(1, res, new, ...): new limits for PID 1, the agent. Root in the sandbox could
    # otherwise wedge it (--as: every exec answered "bad CMD") or end it (--nofile). Reading
    # them (new == NULL) and a process's own limits (pid 0, setrlimit, ulimit) stay allowed.
    rules.append({"names": ["prlimit64"], "action": "SCMP_ACT_ERRNO", "errnoRet": eperm,
                  "args": [{"index": 0, "value": LOW32, "valueTwo": AGENT_PID, "op": "SCMP_CMP_MASKED_EQ"},
                           {"index": 2, "value": 0, "op": "SCMP_CMP_NE"}]})
    for flag in NAMESPACE_FLAGS.values():
        rules.append({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": eperm,
                      "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]})
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
            "syscalls": rules}
