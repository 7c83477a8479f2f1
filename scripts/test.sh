#!/usr/bin/env bash
# Run every test. The edge's unit tests (tests/unit: fake backend, agent stub) first, without
# root privileges (a user namespace: no capabilities on the host); then everything else as root
# (tests start real crun containers, QEMU guests, EROFS mounts and overlays).
set -euo pipefail
cd "$(dirname "$0")/.."
unshare --user .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit
bash scripts/host-setup.sh
exec .venv/bin/pytest -q --ignore=tests/unit "$@"
