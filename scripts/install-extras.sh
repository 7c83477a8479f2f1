#!/usr/bin/env bash
# Optional parts of dsec, one word each (as root, after scripts/install.sh; each is idempotent
# and quick when already there):
#   vm        microVM and full-VM backends: QEMU, the guest kernel, the debian-vm image
#   fncall    the FnCall pool image (python3, gcc, g++, numpy)
#   polyglot  SandboxFusion's languages for FnCall (go, java, node/ts, rust, C#, php, ruby, lua)
#   builds    Dockerfile builds and registry pulls (buildah, skopeo)
#   e2b       the images of E2B's default templates (e2b-base, code-interpreter) and the server's e2b extra
#   cluster   cluster mode: Ray, PostgreSQL
#   ui        the dashboard's browser tests: Debian's chromium and chromium-driver, python selenium
#   traces    OpenTelemetry traces (DSEC_OTLP_ENDPOINT, DSEC_TRACES_FILE): opentelemetry-api and -sdk
#   tests     everything the test suite needs: all of the above, a local registry, the test tools,
#             the Harbor and verl venvs (DSEC_SKIP_VERL=1 leaves verl's ~6 GB out)
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
[ -x .venv/bin/dsec ] || { echo "run scripts/install.sh first (it makes .venv)" >&2; exit 2; }
apt_get() {        # install only what is missing (apt-get update once, and only then)
  local missing=()
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "   apt-get install ${missing[*]}"
  if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq; APT_UPDATED=1; fi
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
image() { .venv/bin/dsec image build "$1" --builtin; }

part_vm() {
  apt_get qemu-system-x86 qemu-utils
  .venv/bin/dsec vm fetch-kernel      # linux-image-cloud-amd64, unpacked, not installed; + initramfs
  image debian-vm                     # full-VM image (own kernel + systemd): ~90 s the first time
}
part_fncall() { image fncall-python; }
part_polyglot() { image fncall-polyglot; }
part_builds() { apt_get buildah skopeo; }
part_e2b() { .venv/bin/pip install -q -e '.[server,e2b]'; image e2b-base; image code-interpreter; }   # E2B's base and code-interpreter-v1
part_cluster() { apt_get postgresql; .venv/bin/pip install -q -e '.[server,cluster,postgres]'; }
# Debian's browser and its matching driver (Selenium must not download either: D5x, "selenium")
part_ui() { apt_get chromium chromium-driver; .venv/bin/pip install -q 'selenium>=4.20,<5'; }
part_traces() { .venv/bin/pip install -q -e '.[server,traces]'; }   # docs/traces.md
part_tests() {
  apt_get git python3-botocore docker-registry openssl gpg gpg-agent   # openssl: self-signed certificates of the egress tests; gpg: the signed apt repository of the package cache tests
  command -v npm >/dev/null || apt_get nodejs npm      # Debian's node (a node of another origin may bring its own npm)
  # the stock E2B JavaScript SDKs, pinned by tests/compat/js/package-lock.json
  [ -d tests/compat/js/node_modules/e2b ] || (cd tests/compat/js && npm ci --no-audit --no-fund --silent)
  part_vm; part_fncall; part_polyglot; part_builds; part_e2b; part_cluster; part_ui; part_traces
  .venv/bin/pip install -q -e '.[server,test]'
  # Harbor (dsec.adapters.harbor) needs Python >= 3.12: its own venv (a pyenv shim on PATH may
  # exist without a usable 3.12 behind it: try each candidate for real)
  local py312="" c
  for c in $(command -v python3.13 python3.12 2>/dev/null) /root/.pyenv/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then py312="$c"; break; fi
  done
  if [ -n "$py312" ]; then
    [ -x .venv-harbor/bin/python ] || "$py312" -m venv .venv-harbor || echo "warning: could not make .venv-harbor"
    .venv-harbor/bin/pip install -q -e '.[harbor]' || echo "warning: .venv-harbor: pip install failed (Harbor tests will skip)"
  else
    echo "note: no python3.12 found: the Harbor adapter's tests will skip"
  fi
  # verl (dsec.adapters.verl_tool) pulls torch and its CUDA wheels (~6 GB): its own venv
  if [ "${DSEC_SKIP_VERL:-0}" != 1 ]; then
    [ -x .venv-verl/bin/python ] || /usr/bin/python3 -m venv .venv-verl || echo "warning: could not make .venv-verl"
    .venv-verl/bin/pip install -q -e '.[verl]' || echo "warning: .venv-verl: pip install failed (verl tests will skip)"
  fi
}

[ $# -gt 0 ] || { sed -n '2,15p' "$0"; exit 2; }
t0=$SECONDS
for part in "$@"; do
  case "$part" in
    vm|fncall|polyglot|builds|e2b|cluster|ui|traces|tests) echo "== $part (+$(( SECONDS - t0 ))s)"; "part_$part" ;;
    *) echo "unknown part '$part': use vm, fncall, polyglot, builds, e2b, cluster, ui, traces or tests" >&2; exit 2 ;;
  esac
done
echo "== done (+$(( SECONDS - t0 ))s)"
