#!/usr/bin/env bash
# Install everything dsec needs on a fresh Debian 12 machine (as root), start the embedded
# single-machine server and run a live sandbox demo (examples/quickstart.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
echo "== Debian packages"
apt-get update -qq
apt-get install -y -qq --no-install-recommends crun erofs-utils debootstrap busybox-static musl-tools \
  gcc libc6-dev zstd tar util-linux iproute2 procps ca-certificates sqlite3 \
  clang libbpf1 linux-libc-dev nftables bpftool git btrfs-progs python3-pyfuse3 fuse3 python3-botocore \
  skopeo docker-registry qemu-system-x86 qemu-utils postgresql buildah libarchive-tools >/dev/null
echo "== host setup"
bash scripts/host-setup.sh
echo "== Python environment (.venv)"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
# the distribution was `dsec` before `dsec-sandbox` (that name is another project on PyPI): a
# venv made then keeps the old one's metadata and entry point beside the new one's
.venv/bin/pip uninstall -q -y dsec >/dev/null 2>&1 || true
.venv/bin/pip install -q -e '.[server,test]'    # client + server + test tools
# Harbor (dsec.adapters.harbor, tests/test_harbor_adapter.py) needs Python >= 3.12: its own venv
# (a pyenv shim on PATH may exist without a usable 3.12 behind it: try each candidate for real)
PY312=""
for c in $(command -v python3.13 python3.12 2>/dev/null) /root/.pyenv/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then PY312="$c"; break; fi
done
if [ -n "$PY312" ]; then
  [ -x .venv-harbor/bin/python ] || "$PY312" -m venv .venv-harbor || echo "warning: could not make .venv-harbor"
  .venv-harbor/bin/pip install -q -e '.[harbor]' || echo "warning: .venv-harbor: pip install failed (Harbor tests will skip)"
else
  echo "note: no python3.12 found: the Harbor adapter's tests will skip"
fi
# verl (dsec.adapters.verl_tool, tests/test_adapter_verl.py) pulls torch and its CUDA wheels
# (~6 GB): its own venv, so the server's stays small; DSEC_SKIP_VERL=1 leaves it out
if [ "${DSEC_SKIP_VERL:-0}" != 1 ]; then
  [ -x .venv-verl/bin/python ] || python3 -m venv .venv-verl || echo "warning: could not make .venv-verl"
  .venv-verl/bin/pip install -q -e '.[verl]' || echo "warning: .venv-verl: pip install failed (verl tests will skip)"
fi
echo "== built-in images (busybox, debian-python, fncall-python via debootstrap; cached after the first run)"
.venv/bin/dsec image build busybox --builtin
.venv/bin/dsec image build debian-python --builtin
.venv/bin/dsec image build fncall-python --builtin    # FnCall pool image: python3, gcc, g++, numpy
.venv/bin/dsec image build code-interpreter --builtin    # E2B code interpreter: ipykernel + dsec-code-interpreter
.venv/bin/dsec image build fncall-polyglot --builtin    # SandboxFusion languages: go, java/junit, node/ts, rust, C#, php, ruby, lua, pytest
# full-VM test image (own kernel + systemd; tests/test_vm_disk.py): ~90 s the first time, ~5 s cached
.venv/bin/dsec image build debian-vm --builtin
echo "== VM guest: kernel (linux-image-cloud-amd64, unpacked, not installed) + initramfs (cached)"
.venv/bin/dsec vm fetch-kernel
if [ "${DSEC_INSTALL_ONLY:-0}" = 1 ]; then exit 0; fi
echo "== starting dsec (embedded: apiserver + edge + SQLite) and running a live sandbox"
.venv/bin/dsec up --background
.venv/bin/python examples/quickstart.py
echo "dsec is running in the background: '.venv/bin/dsec sandbox ls', '.venv/bin/dsec down' to stop it"
