"""uid-range claims (/run/dsec/idranges, backends/container/idmap.py) do not leak: a create that
crashed after its claim but before config.json is released when the sandbox is torn down; a
half-written (empty) claim and claims whose sandbox directory is gone are taken back."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

import pytest

from dsec.agent.build import agent_binary
from dsec.backends.container.driver import ContainerDriver
from dsec.backends.container.idmap import RANGE, IdRanges
from dsec.config import Paths
from dsec.security.netpolicy import Rulesets

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (crun, cgroups, btrfs quotas)")


@pytest.fixture
def registry(tmp_path) -> Path:
    return tmp_path / "idranges"


@pytest.fixture
def driver(registry):
    home = Path(tempfile.mkdtemp(prefix="dsec-idmap-", dir="/var/tmp"))
    paths = Paths(home)
    paths.ensure()
    d = ContainerDriver(paths, agent_binary(paths.bin), Rulesets(home / "rulesets.json"))
    d.ids = IdRanges(registry, first=1 << 29, slots=8)    # a registry of its own, same code
    yield d
    from dsec.testing.isolated import cleanup_home
    cleanup_home(home)


async def test_claim_of_a_create_that_crashed_before_config_json_is_released(driver, registry):
    """The state a crash between the claim and config.json leaves (sandbox dir + claim, no
    config.json): tearing it down, as recovery does with the leftover, frees the claim."""
    sid = f"sb-local.{secrets.token_hex(6)}"
    d = driver.sandbox_dir(sid)
    driver.disk.create_dir(d, 64 << 20)       # as _prepare_bundle does, before the claim
    base = driver.ids.allocate(d)
    assert base == 1 << 29 and (registry / "0").read_text() == str(d.resolve())
    assert driver.id_base(sid) is None         # nothing recorded the base
    await driver.destroy(sid)
    assert not d.exists()
    assert not [n for n in os.listdir(registry) if n.isdigit()], "the claim outlived its sandbox"


def test_half_written_and_stale_claims_are_taken_back(registry, tmp_path):
    live = tmp_path / "live-sandbox"
    live.mkdir()
    ids = IdRanges(registry, first=1 << 29, slots=2)
    (registry / "0").write_text("")            # its writer died mid-write
    (registry / "1").write_text(str(live))     # a live sandbox's claim
    base = ids.allocate(tmp_path)              # every slot claimed: the empty one is stale
    assert base == (1 << 29) + 0 * RANGE
    assert (registry / "1").read_text() == str(live)


def test_opening_the_registry_sweeps_claims_of_gone_sandboxes(registry, tmp_path):
    live = tmp_path / "live-sandbox"
    live.mkdir()
    registry.mkdir()
    (registry / "3").write_text(str(tmp_path / "gone-sandbox"))   # its home was removed uncleanly
    (registry / "4").write_text(str(live))
    (registry / ".5.tmp").write_text("half")
    IdRanges(registry, first=1 << 29, slots=8)                     # an edge starts
    assert sorted(os.listdir(registry)) == [".lock", "4"]


def test_a_claim_costs_the_same_however_many_the_host_holds(registry, tmp_path, monkeypatch):
    """A claim probes from the round-robin hint instead of listing the registry: at 3,000 live
    claims a listing was ~1 ms on tmpfs under the host-wide lock, ~0.09 ms for a probe (D81)."""
    live = tmp_path / "live-sandbox"
    live.mkdir()
    ids = IdRanges(registry, first=1 << 29, slots=64)
    for s in (0, 1, 2, 5, 62, 63):               # other sandboxes' claims (this host, any home)
        (registry / str(s)).write_text(str(live))
    listed = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p=".": listed.append(p) or real_listdir(p))
    got = [(ids.allocate(live) - (1 << 29)) // RANGE for _ in range(3)]
    assert got == [3, 4, 6], "the first free slots from the hint on, skipping claimed ones"
    assert listed == [], "a claim listed the whole registry"
    ids._hint = 61                               # wraps around past the end
    assert (ids.allocate(live) - (1 << 29)) // RANGE == 61
    assert (ids.allocate(live) - (1 << 29)) // RANGE == 7
