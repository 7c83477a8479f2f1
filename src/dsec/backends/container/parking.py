"""Parking a container in place: freeze its cgroup, push its memory out, thaw it on unpark.

A parked container keeps everything (processes, running execs, sessions, files, network
policy): nothing of it is stopped or saved, it just cannot run. Its memory leaves RAM by
reclaim of its own memory cgroup while it is frozen: page cache is dropped (re-read from the
layers or the upper dir when touched), anonymous memory goes to swap, which on dsec hosts is
compressed RAM (zram, scripts/host-setup.sh; ~3-4x). Without swap only page cache leaves.
It comes back page by page as it is touched after the thaw. docs/decisions.md D23.

The reclaim never changes the sandbox's memory limit (no OOM kill is possible because of a
park): cgroup v1 `memory.force_empty` reclaims everything reclaimable, swapping included; v2
`memory.reclaim` (falling back to a temporary `memory.high`, which throttles but never kills).
The settings a park changes on the way (v1 memory.swappiness, v2 memory.swap.max, which crun
sets to 0 for running sandboxes) are saved in `run/parking.json` first and restored after, or
by `settle()` when the edge died in between.

`reclaim()` is the same push-out without the freeze, for a running sandbox nobody used for a
while (the edge's idle reclaim, edge/reclaim.py, D26): what its tasks touch comes back at once,
so only cold memory stays out; bounded in time, and it never freezes, throttles or kills.

Files in the sandbox's run dir: `parking.json` (a park or reclaim is under way), `parked`
(parked: what list_ids reports as PARKED across edge restarts; removed after the thaw).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.container import cgroups
from dsec.types import SandboxFailed, Unavailable

log = logging.getLogger("dsec.backends.container")

FREEZE_TIMEOUT_S = 10.0      # a task in uninterruptible sleep (a hung FUSE read) delays freezing
# a reclaim of a running sandbox ends after this (plus RECLAIM_S_PER_MIB of what it holds): a
# task that keeps allocating could keep the kernel's force_empty loop going
RECLAIM_TIMEOUT_S = 5.0
RECLAIM_S_PER_MIB = 0.01     # ~3x the measured ~3 ms per MiB
PARKING_STATE = "parking.json"
PARKED_MARKER = "parked"


@dataclass(frozen=True)
class MemoryUse:
    resident: int     # charged to the sandbox's memory cgroup now (anon + page cache + kernel)
    swapped: int      # its pages in swap


class CgroupParking:
    """Freeze/thaw and memory push-out of one sandbox's cgroups (`rel`: /dsec/<id>)."""

    def __init__(self, v2: bool):
        self.v2 = v2

    # -- cgroup files ----------------------------------------------------------------------
    def _mem(self, rel: str) -> Path:
        return cgroups.v2_dir(rel) if self.v2 else cgroups.v1_dir("memory", rel)

    def _freezer(self, rel: str) -> Path:
        return cgroups.v2_dir(rel) / "cgroup.freeze" if self.v2 else cgroups.v1_dir("freezer", rel) / "freezer.state"

    def frozen(self, rel: str) -> bool:
        """Whether every task of the sandbox is frozen (FileNotFoundError: its cgroup is gone)."""
        if self.v2:
            events = (cgroups.v2_dir(rel) / "cgroup.events").read_text().split()
            return "frozen" in events and events[events.index("frozen") + 1] == "1"
        return self._freezer(rel).read_text().strip() == "FROZEN"

    def freeze(self, rel: str) -> None:
        """Freeze and wait until it is frozen (v1: FREEZING until every task stopped)."""
        self._freezer(rel).write_text("1" if self.v2 else "FROZEN")
        deadline = time.monotonic() + FREEZE_TIMEOUT_S
        while not self.frozen(rel):
            if time.monotonic() > deadline:
                self.thaw(rel)
                raise Unavailable(f"the sandbox's processes did not freeze within {FREEZE_TIMEOUT_S:g} s "
                                  "(a task in uninterruptible sleep, e.g. slow I/O); it runs on",
                                  field="sandbox_id", fix="retry the suspend later")
            time.sleep(0.001)

    def thaw(self, rel: str) -> None:
        self._freezer(rel).write_text("0" if self.v2 else "THAWED")

    def memory(self, rel: str) -> MemoryUse:
        """What the sandbox holds in RAM and in swap (for the park's result and the tests)."""
        d = self._mem(rel)
        if self.v2:
            swapped = (d / "memory.swap.current").read_text().strip() if (d / "memory.swap.current").exists() else "0"
            return MemoryUse(int((d / "memory.current").read_text()), int(swapped))
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        return MemoryUse(int((d / "memory.usage_in_bytes").read_text()), int(stat.get("swap", 0)))

    # -- park / unpark ---------------------------------------------------------------------
    def park(self, rel: str, run_dir: Path) -> int:
        """Freeze, push the memory out, mark it parked. Returns the bytes that left RAM.
        Blocking (reclaim takes ~2.5 ms per MiB here): call in a thread."""
        self.freeze(rel)
        try:
            before = self.memory(rel).resident
            self._push_out(rel, run_dir)
            after = self.memory(rel).resident
            (run_dir / PARKED_MARKER).write_text(json.dumps({"at": time.time(), "pushed_out": before - after}))
        except BaseException:
            try:
                self.settle(rel, run_dir)     # it runs on as before
            except OSError:
                pass
            raise
        return max(0, before - after)

    def unpark(self, rel: str, run_dir: Path) -> None:
        """Thaw (the memory comes back as it is touched); the marker goes only after the thaw,
        so an edge that dies in between still finds it parked and thaws it again."""
        self.thaw(rel)
        (run_dir / PARKED_MARKER).unlink(missing_ok=True)

    def reclaim(self, rel: str, run_dir: Path) -> int:
        """Push a running sandbox's memory out without freezing it: page cache (the writable
        layer's, and layer pages it touched first) is dropped, anonymous memory goes to swap.
        Its tasks run on; what they touch comes back at once, so mostly cold memory stays out.
        The settings changed on the way are saved and put back as for a park (settle() after a
        crash). Returns the bytes that left RAM; 0 for a parked sandbox or one whose park is
        under way (the edge holds its park lock, this is the backstop). Blocking: in a thread."""
        if (run_dir / PARKED_MARKER).exists() or (run_dir / PARKING_STATE).exists():
            return 0
        before = self.memory(rel).resident
        self._push_out(rel, run_dir, timeout_s=RECLAIM_TIMEOUT_S + RECLAIM_S_PER_MIB * (before >> 20))
        return max(0, before - self.memory(rel).resident)

    def settle(self, rel: str, run_dir: Path) -> None:
        """A park that did not finish (it failed, or the edge died mid-way): put back what it
        changed and thaw. A finished park (the `parked` marker) is left as it is."""
        saved = run_dir / PARKING_STATE
        if saved.exists():
            try:
                self._restore(rel, json.loads(saved.read_text()))
            except ValueError:
                pass
            saved.unlink(missing_ok=True)
        if not (run_dir / PARKED_MARKER).exists() and self.frozen(rel):
            self.thaw(rel)

    def _push_out(self, rel: str, run_dir: Path, timeout_s: float | None = None) -> None:
        """Reclaim everything the cgroup lets go. timeout_s (a running sandbox): at most that
        long, and never a throttling fallback."""
        d = self._mem(rel)
        saved: dict[str, str] = {}
        if self.v2:
            if (d / "memory.swap.max").exists():
                saved["memory.swap.max"] = (d / "memory.swap.max").read_text().strip()
        else:
            saved["memory.swappiness"] = (d / "memory.swappiness").read_text().strip()
        # durable before anything changes: settle() puts it back if the edge dies mid-way
        tmp = run_dir / (PARKING_STATE + ".tmp")
        tmp.write_text(json.dumps(saved))
        os.replace(tmp, run_dir / PARKING_STATE)
        try:
            if self.v2:
                self._reclaim_v2(d, throttle=timeout_s is None)
            else:
                # swappiness 0 (inherited from a host's vm.swappiness=0) would keep anon in RAM
                (d / "memory.swappiness").write_text("100")
                # reclaims until nothing more can go (page cache dropped, anon swapped);
                # the limit is not touched, so nothing can be OOM-killed
                if timeout_s is None:
                    (d / "memory.force_empty").write_text("0")
                else:
                    _force_empty_bounded(d / "memory.force_empty", timeout_s)
        finally:
            self._restore(rel, saved)
            (run_dir / PARKING_STATE).unlink(missing_ok=True)

    def _reclaim_v2(self, d: Path, throttle: bool = True) -> None:
        if (d / "memory.swap.max").exists():
            (d / "memory.swap.max").write_text("max")       # crun's 0: no swap while running
        want = int((d / "memory.current").read_text())
        if (d / "memory.reclaim").exists():
            for arg in (f"{want} swappiness=100", str(want)):   # swappiness= only on newer kernels
                try:
                    (d / "memory.reclaim").write_text(arg)
                    return
                except OSError as e:
                    if e.errno == errno.EAGAIN:   # reclaimed less than asked: all it could
                        return
                    if e.errno != errno.EINVAL:
                        raise
        if not throttle:         # a running sandbox: no memory.high 0, even for a moment
            return
        # kernels before 5.19: a memory.high below the usage reclaims in the write (and only
        # throttles, never kills); put back at once
        high = (d / "memory.high").read_text().strip()
        try:
            (d / "memory.high").write_text("0")
        finally:
            (d / "memory.high").write_text(high)

    def _restore(self, rel: str, saved: dict[str, str]) -> None:
        d = self._mem(rel)
        for name, value in saved.items():
            try:
                (d / name).write_text(value)
            except OSError as e:
                log.warning("could not restore a cgroup setting after parking",
                            extra={"cgroup": rel, "file": name, "error": str(e)})


def _force_empty_bounded(path: Path, timeout_s: float) -> None:
    """memory.force_empty written by a child process, killed after timeout_s: the kernel loops
    while reclaim makes progress, which a running task that keeps allocating can prolong; a
    fatal signal ends the loop (what left RAM by then stays out). Measured here: a sleeping
    task's 64 MiB leave in ~160 ms; a task touching its pages all the time keeps them (~75 ms)."""
    try:
        r = subprocess.run(["/bin/sh", "-c", 'echo 0 > "$0"', str(path)], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("memory.force_empty of a running sandbox took too long: stopped",
                    extra={"cgroup": str(path.parent), "seconds": timeout_s})
        return
    if r.returncode != 0:
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "the sandbox's memory cgroup is gone", str(path))
        raise OSError(errno.EIO, f"memory.force_empty failed: {r.stderr.strip()}", str(path))


def cgroup_gone(sandbox_id: str, e: OSError) -> SandboxFailed:
    """The error for a park/unpark of a sandbox whose cgroup has gone (it died)."""
    return SandboxFailed(f"sandbox {sandbox_id} is gone (its cgroup no longer exists: {e.strerror})",
                         field="sandbox_id", fix="create a new sandbox")
