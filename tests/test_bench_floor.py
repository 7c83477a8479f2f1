"""The floor of a cold burst (bench/floor.py, D103): crun with dsec's containment replayed from the
driver's own config and nsexec, against the session server's home, real crun, tiny bursts. No
timing assertions: benchmarks are not timed unit tests."""

from __future__ import annotations

import json
import os

from dsec.backends.container import cgroups
from dsec.bench.floor import (
    FLOOR_CGROUP_PARENT,
    PARTS,
    VARIANTS,
    Floor,
    Kit,
    floor_burst,
)
from dsec.config import Paths
from dsec.images.service import ImageService


def _kit(server) -> Kit:
    paths = Paths(server.home)
    return Kit(paths, ImageService(paths).mount_image("busybox")[0])


def test_full_replays_the_drivers_containment(server) -> None:
    kit = _kit(server)
    fl = Floor(kit, kit.paths.home / f"floor-test-{os.getpid()}")
    try:
        full = fl.prepare("ft-full", frozenset())
        cfg = json.loads((full.dir / "config.json").read_text())
        lx = cfg["linux"]
        assert cfg["process"]["args"] == ["echo", "hi"]
        assert lx["cgroupsPath"] == f"{FLOOR_CGROUP_PARENT}/ft-full"
        assert {"network", "mount", "pid"} <= {n["type"] for n in lx["namespaces"]}
        assert lx["seccomp"] and lx["maskedPaths"] and lx["readonlyPaths"]
        assert lx["resources"]["memory"]["limit"] == 256 << 20 and lx["resources"]["pids"]["limit"]
        assert full.argv[0] == str(kit.nsexec) and "--" in full.argv
        if kit.ids is not None:      # the node's default: own user namespace, idmapped layer
            assert "user" in {n["type"] for n in lx["namespaces"]} and "-u" in full.argv and "-l" in full.argv
        if kit.view is not None:
            assert any(m["source"].startswith(str(kit.view)) for m in cfg["mounts"])
        # each variant switches off its part only
        no_sc = json.loads((fl.prepare("ft-nosc", frozenset({"seccomp"})).dir / "config.json").read_text())
        assert "seccomp" not in no_sc["linux"] and no_sc["linux"]["maskedPaths"] == lx["maskedPaths"]
        no_net = json.loads((fl.prepare("ft-nonet", frozenset({"netns"})).dir / "config.json").read_text())
        assert "network" not in {n["type"] for n in no_net["linux"]["namespaces"]} and "sysctl" not in no_net["linux"]
        bare = fl.prepare("ft-bare", VARIANTS["bare"])
        bcfg = json.loads((bare.dir / "config.json").read_text())
        assert bare.argv[0] == "crun" and bcfg["root"] == {"path": str(kit.rootfs), "readonly": True}
        assert bcfg["linux"]["resources"] == {"devices": lx["resources"]["devices"]}
        assert set(VARIANTS) == {"full", "bare", *(f"no-{p}" for p in PARTS)}
    finally:
        left = fl.cleanup()
        fl.close()
    assert left == [] and not fl.root.exists()


async def test_every_variant_bursts_and_leaves_nothing(server) -> None:
    kit = _kit(server)
    for v in VARIANTS:
        r = await floor_burst(kit, 2, v, tag=f"t{v[:6]}")
        assert r["n"] == 2 and r["failed"] == 0, (v, r["errors"])
        assert r["p50_ms"] > 0 and r["cpu_ms_per_create"] > 0 and r["prep_ms"] > 0
        assert r["cgroups_left"] == [] and r["variant"] == v and r["off"] == sorted(VARIANTS[v])
    assert cgroups.leftover_dirs(FLOOR_CGROUP_PARENT) == []
    assert not any(p.name.startswith("floor-") for p in kit.paths.home.iterdir())
    if kit.ids is not None:          # every id range given back
        assert not [p for p in kit.ids.registry.iterdir()
                    if not p.name.startswith(".") and "floor-" in p.read_text()]
