#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine (as root): install what the embedded single-machine
# server needs, start it and run a live sandbox (examples/quickstart.py). A few minutes, each
# step announced. Optional parts (microVMs/VMs, FnCall languages, Dockerfile builds, E2B's code
# interpreter, cluster mode) and what only the tests need: scripts/install-extras.sh (README).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
t0=$SECONDS
step() { echo "== [$1/6] $2 (+$(( SECONDS - t0 ))s)"; }

step 1 "Debian packages: crun, EROFS and overlay tools, the agent's compiler, network policy (BPF, nftables), lxcfs"
apt-get update -qq
lxcfs_new=$(dpkg-query -W -f='${Status}' lxcfs 2>/dev/null | grep -q "ok installed" || echo 1)
apt-get install -y -qq --no-install-recommends python3 python3-venv crun erofs-utils debootstrap busybox-static \
  musl-tools gcc libc6-dev zstd tar util-linux iproute2 procps ca-certificates sqlite3 clang libbpf1 \
  linux-libc-dev nftables bpftool btrfs-progs python3-pyfuse3 fuse3 libarchive-tools lxcfs >/dev/null
# sandboxes' /proc/meminfo etc. (D48): dsec starts its own lxcfs on <home>/lxcfs; the distribution's
# host-wide service is not used (left alone where it was installed before)
if [ -n "$lxcfs_new" ] && [ -d /run/systemd/system ]; then systemctl disable --now lxcfs >/dev/null 2>&1 || true; fi
step 2 "host setup (cgroups, EROFS/overlay/btrfs modules, compressed swap)"
bash scripts/host-setup.sh
step 3 "Python environment (.venv, from Debian's python3)"
[ -x .venv/bin/python ] || /usr/bin/python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
# the distribution was `dsec` before `dsec-sandbox` (that name is another project on PyPI): a
# venv made then keeps the old one's metadata and entry point beside the new one's
.venv/bin/pip uninstall -q -y dsec >/dev/null 2>&1 || true
.venv/bin/pip install -q -e '.[server]'          # client + server
step 4 "built-in images busybox and debian-python (debootstrap from the Debian mirror; cached after the first run)"
.venv/bin/dsec image build busybox --builtin
.venv/bin/dsec image build debian-python --builtin
if [ "${DSEC_INSTALL_ONLY:-0}" = 1 ]; then exit 0; fi
step 5 "starting dsec (embedded: apiserver + edge + SQLite)"
.venv/bin/dsec up --background
step 6 "a live sandbox"
.venv/bin/python examples/quickstart.py
echo "dsec is running in the background (+$(( SECONDS - t0 ))s): '.venv/bin/dsec sandbox ls', '.venv/bin/dsec down' to stop it"
echo "optional parts: bash scripts/install-extras.sh vm|fncall|polyglot|builds|e2b|cluster (README, 'Optional parts')"
