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
# favordynmods (docs/decisions.md D92): cgroup.procs writes (crun makes one per hierarchy per
# sandbox start) otherwise take a host-wide lock whose first write after a quiet spell waits an RCU
# grace period (10-23 ms a start measured) and stalls every fork/exit meanwhile; 6.18 gives each
# process its own lock instead. The switch is host-wide, so one mount carries it: the cgroup v2 one
# (pure or hybrid), remounted with its own options kept. Never turned off: on 6.18 that leaves the
# kernel half switched. Kernels without it (< 6.1) or hosts without cgroup2 start as before.
setup_favordynmods() {
  local m="" opts
  grep -qw favordynmods /sys/kernel/cgroup/features 2>/dev/null || return 0
  if [ -e /sys/fs/cgroup/cgroup.controllers ]; then m=/sys/fs/cgroup
  elif [ -e /sys/fs/cgroup/unified/cgroup.controllers ]; then m=/sys/fs/cgroup/unified
  else return 0; fi
  # super options of that mount (mountinfo: "... - cgroup2 cgroup2 rw,nsdelegate,...")
  opts=$(awk -v m="$m" '$5 == m { for (i = 7; i <= NF; i++) if ($i == "-") { print $(i + 3); exit } }' /proc/self/mountinfo)
  case ",$opts," in *,favordynmods,*) return 0;; esac
  opts=$(printf '%s' "$opts" | tr ',' '\n' | { grep -vx -e rw -e ro || true; } | paste -sd, -)
  mount -o "remount${opts:+,$opts},favordynmods" "$m" || \
    echo "warning: could not remount $m with favordynmods: each sandbox start waits for the kernel's cgroup lock" >&2
}
setup_favordynmods
# crun from a read-only bind (D92, backends/container/crun_bin.py): crun re-executes itself from
# a read-only copy before every command (CVE-2019-5736) unless its binary is on a read-only mount
# already; this bind is that mount, made once per boot, so a start skips a tmp file, two mounts
# and a second exec. Rebound when crun was upgraded (a new file); the driver checks it is the same
# file and read-only before it uses it, and runs crun itself otherwise.
setup_crun_ro() {
  local crun ro=/run/dsec/crun
  crun=$(command -v crun) || return 0
  crun=$(readlink -f "$crun")
  mkdir -p /run/dsec
  if mountpoint -q "$ro" 2>/dev/null; then
    [ "$(stat -c %d:%i "$ro")" = "$(stat -c %d:%i "$crun")" ] && return 0
    umount -l "$ro"                            # a former crun: bind the one installed now
  fi
  [ -e "$ro" ] || install -m 0755 /dev/null "$ro"
  if ! { mount --bind "$crun" "$ro" && mount -o remount,bind,ro "$ro"; }; then
    echo "warning: could not bind $crun read-only at $ro: crun copies itself at every start" >&2
    umount "$ro" 2>/dev/null || true
  fi
}
setup_crun_ro
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
# size (default: twice the RAM's size, at most 64 GiB; it takes RAM only for what it holds,
# ~1/2-1/3 of that compressed, plus ~0.1% of the size in metadata); 0 turns it off. Half the
# RAM filled at 643 dozing microVM clones of 256 MiB, the RAM's size at ~550 (the awake peak
# swapped too); 800 dozing clones put 30.8-35.1 GiB there, 1.5x the RAM of this box (D95).
# vm.swappiness is left as the host has it: a park squeezes with the sandbox cgroup's own
# swappiness (v1 memory.swappiness, v2 memory.reclaim swappiness=), so the host-wide knob only
# governs global reclaim, where the host default keeps running sandboxes' anon memory in RAM.
setup_zram() {
  local mb="${DSEC_ZRAM_MB:-}" dev="" n alg
  if [ -z "$mb" ]; then
    mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 2 / 1024 ))
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
