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
# Compressed swap for parking containers (docs/decisions.md D23): a parked (frozen) container's
# anonymous memory can only leave RAM through swap; zram keeps it compressed in RAM (~3-4x
# here), no disk needed. Set up once per boot if no zram swap is active; a swap that is not
# ours (another zram device, a disk swap) is never touched. DSEC_ZRAM_MB: its uncompressed
# size (default: half the RAM, at most 64 GiB); 0 turns it off.
# vm.swappiness is left as the host has it: a park squeezes with the sandbox cgroup's own
# swappiness (v1 memory.swappiness, v2 memory.reclaim swappiness=), so the host-wide knob only
# governs global reclaim, where the host default keeps running sandboxes' anon memory in RAM.
setup_zram() {
  local mb="${DSEC_ZRAM_MB:-}" dev="" n alg
  if [ -z "$mb" ]; then
    mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 2048 ))
    [ "$mb" -gt 65536 ] && mb=65536
  fi
  [ "$mb" -gt 0 ] 2>/dev/null || return 0
  if awk 'NR > 1 && $1 ~ "^/dev/zram" {found=1} END {exit !found}' /proc/swaps; then
    return 0                                   # a zram swap is active (ours from before, or not)
  fi
  modprobe zram 2>/dev/null || true
  if [ ! -e /sys/class/zram-control/hot_add ] && [ ! -e /sys/block/zram0 ]; then
    echo "warning: kernel has no zram: containers park without compressed swap (only page cache leaves RAM)" >&2
    return 0
  fi
  # a device of our own: zram0 if nobody set it up (disksize 0, not held), else a new one
  if [ -e /sys/block/zram0 ] && [ "$(cat /sys/block/zram0/disksize)" = 0 ] && \
     [ -z "$(ls -A /sys/block/zram0/holders 2>/dev/null)" ]; then
    dev=zram0
  elif [ -e /sys/class/zram-control/hot_add ]; then
    n=$(cat /sys/class/zram-control/hot_add 2>/dev/null) && dev="zram$n"
  fi
  if [ -z "$dev" ] || [ ! -e "/sys/block/$dev" ]; then
    echo "warning: no free zram device (zram0 is in use, hot_add failed): containers park without compressed swap" >&2
    return 0
  fi
  for alg in lz4 zstd; do                      # fast first; the kernel default otherwise
    if grep -qw "$alg" "/sys/block/$dev/comp_algorithm"; then
      echo "$alg" > "/sys/block/$dev/comp_algorithm" 2>/dev/null && break
    fi
  done
  if ! { echo "${mb}M" > "/sys/block/$dev/disksize" && mkswap -q "/dev/$dev" >/dev/null && \
         swapon -p 32000 "/dev/$dev"; }; then
    echo "warning: could not set up zram swap on /dev/$dev: containers park without compressed swap" >&2
    echo 1 > "/sys/block/$dev/reset" 2>/dev/null || true
    return 0
  fi
}
setup_zram
# Memory merging for VMs (docs/decisions.md D73, docs/security.md "Memory merging"): ksmd merges
# only memory a process marked mergeable, and the only such memory dsec makes is its VMs' QEMUs
# (DSEC_VM_KSM, default all). Clones of one template share many of their private pages (TCG TLBs,
# guest pages written alike; docs/benchmarks.md vm-density) for a few % of a core. DSEC_KSM=0
# leaves ksmd as the host has it (and closes the cross-VM timing side channel with
# DSEC_VM_KSM=0). dsec works without it: nothing is merged, every clone costs its own pages.
setup_ksm() {
  local k=/sys/kernel/mm/ksm
  [ "${DSEC_KSM:-1}" = 0 ] && return 0
  if [ ! -w "$k/run" ]; then
    echo "warning: kernel has no KSM (/sys/kernel/mm/ksm): idle VMs do not share identical pages" >&2
    return 0
  fi
  [ "$(cat "$k/run")" = 1 ] && return 0        # already on (ours from before, or the host's)
  echo "${DSEC_KSM_PAGES_TO_SCAN:-1000}" > "$k/pages_to_scan"
  [ -w "$k/use_zero_pages" ] && echo 1 > "$k/use_zero_pages"
  echo 1 > "$k/run"
}
setup_ksm
