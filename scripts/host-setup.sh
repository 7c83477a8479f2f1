#!/usr/bin/env bash
# Host preparation dsec needs at every boot (idempotent). See shared host-facts: crun refuses
# "hybrid" cgroups while cgroup2 holds hugetlb, so hugetlb is moved to its own v1 hierarchy.
set -euo pipefail
if [ ! -e /sys/fs/cgroup/cgroup.controllers ] && [ -e /sys/fs/cgroup/unified/cgroup.controllers ]; then
  if grep -qw hugetlb /sys/fs/cgroup/unified/cgroup.controllers; then
    mkdir -p /sys/fs/cgroup/hugetlb
    mountpoint -q /sys/fs/cgroup/hugetlb || mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb
  fi
fi
modprobe erofs 2>/dev/null || true
modprobe overlay 2>/dev/null || true
grep -qw erofs /proc/filesystems || { echo "kernel has no EROFS support" >&2; exit 1; }
grep -qw overlay /proc/filesystems || { echo "kernel has no overlayfs support" >&2; exit 1; }
# Disk quotas (docs/decisions.md D11): the edge loop-mounts one sparse btrfs image per node at
# DSEC_HOME/sb itself (it needs to know DSEC_HOME); here only the kernel side. Without these
# dsec still runs, with polled quotas (logged as a warning).
modprobe loop 2>/dev/null || true
modprobe btrfs 2>/dev/null || true
[ -e /dev/loop-control ] || echo "warning: no loop devices: disk quotas will be polled, not enforced" >&2
grep -qw btrfs /proc/filesystems || echo "warning: kernel has no btrfs: disk quotas will be polled, not enforced" >&2
command -v mkfs.btrfs >/dev/null || echo "warning: mkfs.btrfs missing (apt-get install btrfs-progs): disk quotas will be polled" >&2
