"""Fixtures of the containment (attack) suite.

Every test in tests/containment is an attack run from inside a sandbox. The autouse fixture
`node_intact` checks, after each one, that the attack stayed inside its sandbox:
  - host: watched host files (incl. a canary the attacks try to reach) are byte-identical;
    hostname and wall clock unchanged; no sandbox mount (overlay, proc, tmpfs ...) appeared in
    the host mount table; no process of a stopped sandbox of ours is left; the server is healthy
    and a fresh sandbox still works;
  - neighbour: a sandbox of the same server, created before the attacks, still runs; its marker
    file, its background process, its busybox binary and its hostname are unchanged.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from containment._util import clock_offset, host_mounts_of, pids_by_sandbox, sha256

WATCHED_HOST_FILES = ("/etc/hostname", "/etc/passwd", "/etc/hosts", "/usr/bin/bash", "/bin/busybox")


@pytest.fixture(scope="session")
def host_canary(dsec_home):
    """A host file no sandbox may read or change (attacks aim at it by path)."""
    p = Path("/var/tmp") / f"dsec-cx-canary-{secrets.token_hex(6)}.txt"
    p.write_text("HOST-CANARY-" + secrets.token_hex(16))
    p.chmod(0o644)
    yield p
    p.unlink(missing_ok=True)


@pytest.fixture(scope="module")
async def cx(server):
    """A client for module-scoped sandboxes (the `client` fixture is per test)."""
    c = server.client()
    async with c:
        yield c


@dataclass
class Neighbour:
    sb: object
    marker: str
    bg_pid: int
    busybox_sha: str

    async def check(self) -> None:
        info = await self.sb.refresh()
        assert info.state.value == "running", f"neighbour sandbox is {info.state.value}: {info.error}"
        assert (await self.sb.files.read("/work/marker.txt")).decode() == self.marker
        r = await self.sb.run(f"cat /work/marker.txt; echo; kill -0 {self.bg_pid} && echo alive; "
                              "sha256sum /bin/busybox; hostname", timeout_s=30)
        lines = r.stdout.split("\n")
        assert lines[0] == self.marker, r
        assert lines[1] == "alive", f"neighbour's background process is gone: {r}"
        assert lines[2].split()[0] == self.busybox_sha, "neighbour's /bin/busybox changed"
        assert lines[3] == "sandbox", f"neighbour's hostname changed: {lines[3]!r}"


@pytest.fixture(scope="module")
async def neighbour(cx):
    """A sandbox next to the attackers, with a marker file and a long-running process."""
    sb = await cx.create_container(image="busybox", labels={"role": "neighbour"})
    marker = "NEIGHBOUR-" + secrets.token_hex(16)
    await sb.files.write("/work/marker.txt", marker)
    bg = await sb.run("sleep 100000 >/dev/null 2>&1 & echo $!")
    bb = (await sb.run("sha256sum /bin/busybox")).stdout.split()[0]
    yield Neighbour(sb, marker, int(bg.stdout), bb)
    await sb.stop()


@pytest.fixture(scope="module")
async def attacker(cx):
    """A long-lived debian-python sandbox (default user: uid 1000) for non-destructive attacks."""
    sb = await cx.create_container(image="debian-python", labels={"role": "attacker"})
    yield sb
    await sb.stop()


def _describe(stray: dict[str, set[int]]) -> dict:
    out = {}
    for sid, pids in stray.items():
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().split()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out[f"{sid}/{pid}"] = f"state={stat[2]} cmd={cmd!r}"
            except OSError:
                out[f"{sid}/{pid}"] = "gone"
    return out


def _host_snapshot(server, canary: Path) -> dict:
    files = [*WATCHED_HOST_FILES, str(canary)]
    files += [str(p) for p in sorted((server.home / "bin").glob("*")) if p.is_file()]   # agent, nsexec
    return {"files": {f: sha256(f) for f in files if Path(f).exists()},
            "hostname": socket.gethostname(),
            "clock": clock_offset()}


@pytest.fixture(autouse=True)
async def node_intact(server, cx, neighbour, host_canary):
    """After every attack: host, node and neighbour unchanged, a fresh sandbox still works."""
    before = _host_snapshot(server, host_canary)
    yield
    after = _host_snapshot(server, host_canary)
    changed = [f for f, h in before["files"].items() if after["files"].get(f) != h]
    assert not changed, f"host files changed: {changed}"
    assert after["hostname"] == before["hostname"], "host hostname changed"
    assert abs(after["clock"] - before["clock"]) < 2.0, "host wall clock jumped"
    # no sandbox mount leaked into the host's mount table: only the EROFS layers and the
    # scratch filesystem of the sandbox dirs (disk quotas) may be mounted there, and the
    # node's lxcfs (D50; sandboxes get binds of its files)
    node_mounts = {(str(server.home / "lxcfs"), "fuse.lxcfs")}
    leaked = [m for m in host_mounts_of(server.home) if m[1] not in ("erofs", "btrfs") and m not in node_mounts]
    assert not leaked, f"sandbox mounts visible on the host: {leaked}"
    assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200
    # no process of one of our sandboxes outlives it
    ours = {s.id: s.state.value for s in await cx.list(include_ended=True)}
    for _ in range(40):     # killed processes may take a moment to be reaped after a stop
        stray = {sid: pids for sid, pids in pids_by_sandbox().items() if sid in ours and ours[sid] != "running"}
        if not stray:
            break
        await asyncio.sleep(0.1)
    assert not stray, f"processes of ended sandboxes still run on the host: {_describe(stray)}"
    await neighbour.check()
    fresh = await cx.create_container(image="busybox")
    try:
        r = await fresh.run("echo fresh-ok; hostname", timeout_s=30)
        assert r.stdout == "fresh-ok\nsandbox\n", r
    finally:
        await fresh.stop()
