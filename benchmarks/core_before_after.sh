#!/usr/bin/env bash
# `dsec bench core` of two commits, alternating, each on its own DSEC_HOME (they may differ in
# schema), with the same venv: BEFORE and AFTER are git refs, ROUNDS the number of pairs.
#   bash benchmarks/core_before_after.sh c1b0a8e HEAD 3
# Results: /tmp/bench-{before,after}-N.md (one `dsec bench core` section each).
set -u
BEFORE=${1:?before ref}; AFTER=${2:?after ref}; ROUNDS=${3:-3}
ARGS=${BENCH_ARGS:---n-create 100 --n-idle 200 --n-exec 300}
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
for side in before after; do
  ref=$BEFORE; [ $side = after ] && ref=$AFTER
  rm -rf /tmp/dsec-$side; git worktree add -f /tmp/dsec-$side "$ref" -q
  mkdir -p /var/tmp/bench-$side
  [ -e /var/tmp/bench-$side/cache ] || ln -s /var/lib/dsec/cache /var/tmp/bench-$side/cache
done
run() {
  local side=$1 i=$2
  export DSEC_HOME=/var/tmp/bench-$side PYTHONPATH=/tmp/dsec-$side/src
  $PY -m dsec image build debian-python --builtin >/dev/null 2>&1
  $PY -m dsec bench core $ARGS --out /tmp/bench-$side-$i.md > /tmp/bench-$side-$i.log 2>&1
  echo "$side $i rc=$? load=$(cut -d' ' -f1 /proc/loadavg)"
  $PY -m dsec down >/dev/null 2>&1
}
for i in $(seq 1 "$ROUNDS"); do run before "$i"; run after "$i"; done
# leave nothing behind: the worktrees, and each home's scratch mount (dsec down keeps it for a restart)
for side in before after; do
  umount /var/tmp/bench-$side/sb 2>/dev/null
  # the home's lxcfs outlives `dsec down` by design (D50): stop it before removing the home
  $PY -c "import sys; from pathlib import Path; from dsec.backends.container.lxcfs import Lxcfs; Lxcfs(Path(sys.argv[1])).stop()" \
    /var/tmp/bench-$side/lxcfs 2>/dev/null || umount -l /var/tmp/bench-$side/lxcfs 2>/dev/null
  rm -rf /var/tmp/bench-$side
  git worktree remove --force /tmp/dsec-$side
done
