#!/usr/bin/env bash
# Run every test. First what only the tests need, installed when missing (scripts/install-extras.sh
# tests: quick when it is all there). The edge's unit tests (tests/unit: fake backend, agent
# stub) without root privileges (a user namespace: no capabilities on the host); then everything
# else as root (tests start real crun containers, QEMU guests, EROFS mounts and overlays).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/dsec ] || DSEC_INSTALL_ONLY=1 bash scripts/install.sh
bash scripts/install-extras.sh tests
unshare --user .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit
bash scripts/host-setup.sh
exec .venv/bin/pytest -q --ignore=tests/unit "$@"
