"""Default containment profile shared by every container sandbox.

This is the baseline the platform core ships with; the containment issue extends it (seccomp,
Landlock, cgroup-BPF network policy). Kept as data so specs and tests can assert on it.
"""

from __future__ import annotations

# Docker's default set minus NET_RAW (raw sockets / spoofing), MKNOD (device nodes),
# AUDIT_WRITE, SETFCAP and SYS_CHROOT (chroot is also denied by seccomp). The agent needs SETUID/SETGID/CHOWN/DAC_OVERRIDE/FOWNER/KILL to run
# commands and file operations as the sandbox user; non-root commands get none of these.
CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_KILL",
)

# Kernel interfaces a sandbox has no business reading: host memory, page metadata (a recursive
# grep over /proc/kpagecgroup crashed a kernel in the reference system), keys, timers, firmware.
MASKED_PATHS: tuple[str, ...] = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/proc/kpagecgroup", "/proc/kpagecount", "/proc/kpageflags", "/proc/kmsg",
    "/proc/sysrq-trigger", "/sys/firmware", "/sys/kernel/debug", "/sys/kernel/security",
    "/sys/devices/virtual/powercap",
)

READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
)
