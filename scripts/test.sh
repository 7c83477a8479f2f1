#!/usr/bin/env bash
# Run every test (as root: tests start real crun containers, EROFS mounts and overlays).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/host-setup.sh
exec .venv/bin/pytest -q "$@"
