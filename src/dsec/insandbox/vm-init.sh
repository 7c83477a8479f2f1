#!/bin/sh
# dsec guest init: /init of the initramfs that guest.py builds (busybox sh, applets by symlink).
# Boot contract: see the docstring of dsec/backends/vm/guest.py. In short: mount the EROFS
# layers (virtio-blk serial dsec-l0..N-1, or /dev/pmem0..N-1 with dsec.pmem=1) and the writable
# ext4 disk (serial dsec-upper) as an overlay root, put the agent on a read-only tmpfs at /.dsec
# in it, then switch_root so that the agent becomes PID 1 on the virtio-serial port dsec.agent.
# Any failure prints "dsec-init: error: ..." on the console and exits: the kernel panics
# ("Attempted to kill init"), and with panic=-1 plus QEMU's -no-reboot the VM stops.

fail() {
	echo "dsec-init: error: $*" >&2
	exit 1
}

mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"

LAYERS=0 PMEM=0 WORKDIR=/ UID_=0 GID_=0 NOFILE=4096 HOSTNAME_=sandbox WAIT_MS=20000 FSIZE=0 DNS=
for p in $(cat /proc/cmdline); do
	case "$p" in
	dsec.layers=*) LAYERS=${p#*=} ;;
	dsec.pmem=*) PMEM=${p#*=} ;;
	dsec.workdir=*) WORKDIR=${p#*=} ;;
	dsec.uid=*) UID_=${p#*=} ;;
	dsec.gid=*) GID_=${p#*=} ;;
	dsec.nofile=*) NOFILE=${p#*=} ;;
	dsec.fsize=*) FSIZE=${p#*=} ;;
	dsec.hostname=*) HOSTNAME_=${p#*=} ;;
	dsec.wait_ms=*) WAIT_MS=${p#*=} ;;
	dsec.dns=*) DNS=${p#*=} ;;
	esac
done
[ "$LAYERS" -ge 1 ] 2>/dev/null || fail "dsec.layers=$LAYERS: need at least one layer"

# Modules in dependency order (resolved on the host from each module's modinfo "depends").
# The pmem group is only needed for dsec.pmem=1 (q35), the pci group only where there is PCI
# (not on microvm): skip them otherwise, insmod costs under TCG.
HAVE_PCI=0
[ -n "$(ls /sys/bus/pci/devices 2>/dev/null)" ] && HAVE_PCI=1
while read -r group mod; do
	[ "$group" = pmem ] && [ "$PMEM" != 1 ] && continue
	[ "$group" = pci ] && [ "$HAVE_PCI" != 1 ] && continue
	[ "$group" = net ] && [ -z "$DNS" ] && continue
	insmod "/lib/modules/$mod" || fail "insmod $mod"
done </etc/dsec/modules

# Poll (bounded) for a device to show up: virtio probing may finish after insmod returns.
waited=0
wait_for() { # wait_for DESCRIPTION COMMAND...: run COMMAND until it succeeds
	desc=$1
	shift
	until "$@"; do
		[ "$waited" -ge "$WAIT_MS" ] && fail "timed out waiting for $desc"
		usleep 5000
		waited=$((waited + 5))
	done
}

# virtio-blk disk by serial -> /dev/vdX (in $DEV)
by_serial() {
	for d in /sys/block/vd*; do
		[ -e "$d/serial" ] || continue
		if [ "$(cat "$d/serial")" = "$1" ]; then
			DEV=/dev/${d##*/}
			return 0
		fi
	done
	return 1
}

mkdir -p /lower /upperfs /newroot
lowerdirs=
i=0
while [ "$i" -lt "$LAYERS" ]; do
	mkdir -p "/lower/$i"
	if [ "$PMEM" = 1 ]; then
		DEV=/dev/pmem$i
		wait_for "$DEV" test -b "$DEV"
		mount -t erofs -o ro,dax "$DEV" "/lower/$i" || fail "mount $DEV (erofs, dax)"
	else
		wait_for "disk dsec-l$i" by_serial "dsec-l$i"
		mount -t erofs -o ro "$DEV" "/lower/$i" || fail "mount $DEV (erofs dsec-l$i)"
	fi
	lowerdirs="/lower/$i${lowerdirs:+:$lowerdirs}" # overlay wants the top layer first
	i=$((i + 1))
done

wait_for "disk dsec-upper" by_serial dsec-upper
mount -t ext4 -o noatime "$DEV" /upperfs || fail "mount $DEV (ext4 dsec-upper)"
mkdir -p /upperfs/upper /upperfs/work || fail "mkdir upper/work on dsec-upper"
mount -t overlay -o "lowerdir=$lowerdirs,upperdir=/upperfs/upper,workdir=/upperfs/work" \
	overlay /newroot || fail "mount overlay root"

# The agent lives outside the writable tree: a small tmpfs, read-only once populated.
mkdir -p /newroot/.dsec /newroot/proc /newroot/sys /newroot/dev /newroot/tmp
mount -t tmpfs -o size=4m,mode=0755,nosuid,nodev dsec /newroot/.dsec || fail "mount /.dsec"
cp /dsec/agent /newroot/.dsec/agent || fail "copy agent"
if [ -n "$DNS" ]; then
	# every guest has the same address on its own QEMU user-mode network; port 53 to any
	# address reaches the node's forwarder, which answers only what the sandbox's policy allows
	printf 'nameserver %s\noptions timeout:2 attempts:2\n' "$DNS" >/newroot/.dsec/resolv.conf
fi
mount -o remount,ro /newroot/.dsec || fail "remount /.dsec ro"

# Agent channel: the virtio-serial port named dsec.agent (no udev here: look it up in sysfs).
port_by_name() {
	for d in /sys/class/virtio-ports/*; do
		[ -e "$d/name" ] || continue
		if [ "$(cat "$d/name")" = dsec.agent ]; then
			PORT=/dev/${d##*/}
			return 0
		fi
	done
	return 1
}
wait_for "virtio-serial port dsec.agent" port_by_name
wait_for "$PORT" test -c "$PORT"

hostname "$HOSTNAME_"
ifconfig lo 127.0.0.1 up 2>/dev/null
if [ -n "$DNS" ]; then
	wait_for "network device eth0" test -e /sys/class/net/eth0
	ifconfig eth0 10.0.2.15 netmask 255.255.255.0 up || fail "configure eth0"
	route add default gw 10.0.2.2 || fail "default route"
	rm -f /newroot/etc/resolv.conf && : >/newroot/etc/resolv.conf || fail "resolv.conf"
	mount --bind /newroot/.dsec/resolv.conf /newroot/etc/resolv.conf || fail "bind resolv.conf"
	mount -o remount,bind,ro /newroot/etc/resolv.conf 2>/dev/null
fi

mount --move /dev /newroot/dev || fail "move /dev"
mount --move /proc /newroot/proc || fail "move /proc"
mount --move /sys /newroot/sys || fail "move /sys"
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts /newroot/dev/pts
[ -e /newroot/dev/ptmx ] || ln -s pts/ptmx /newroot/dev/ptmx
mount -t tmpfs -o mode=1777,nosuid,nodev shm /newroot/dev/shm
echo "dsec-init: root ready, starting agent on $PORT"
exec switch_root /newroot /.dsec/agent -D "$PORT" -w "$WORKDIR" -u "$UID_" -g "$GID_" \
	-n "$NOFILE" -F "$FSIZE"
