"""The volume store's records (dsec.volumes.store) on a plain directory: names unique per
project, another project's volume never found, the project's total size bounded, deletion
frees the name (the real removers, btrfs and rmtree, are checked by tests/containment/test_cx_volumes.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsec.backends.base import VolumeDirs
from dsec.types import CapacityExceeded, Conflict, NotFound, VolumeCreate
from dsec.volumes.store import VolumeStore


class PlainDirs(VolumeDirs):
    volumes_enforced = False

    def __init__(self, root: Path):
        self.root = root

    def volume_root(self) -> Path:
        return self.root

    def make_volume_dir(self, d: Path, limit_bytes: int) -> None:
        d.mkdir(mode=0o755)

    def remove_volume_dir(self, d: Path) -> None:
        shutil.rmtree(d)

    def volume_usage(self, d: Path) -> int:
        return sum(p.lstat().st_size for p in d.rglob("*"))


def test_names_projects_limits_and_delete(tmp_path: Path) -> None:
    store = VolumeStore(PlainDirs(tmp_path / "vols"))
    a = store.create("pa", VolumeCreate(name="data", size_mb=60), project_limit_mb=100)
    with pytest.raises(Conflict, match="already has"):
        store.create("pa", VolumeCreate(name="data", size_mb=1), project_limit_mb=100)
    b = store.create("pb", VolumeCreate(name="data", size_mb=60), project_limit_mb=100)   # its own name space
    assert a["id"] != b["id"] and store.find("pb", "data")["id"] == b["id"]
    with pytest.raises(CapacityExceeded, match="DSEC_VOLUMES_PROJECT_GB") as e:
        store.create("pa", VolumeCreate(name="more", size_mb=41), project_limit_mb=100)
    assert e.value.field == "size_mb"
    assert [r["name"] for r in store.records("pa")] == ["data"]
    with pytest.raises(NotFound) as nf:
        store.find("pc", "data", field="volumes[0].name")
    assert nf.value.field == "volumes[0].name"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("host file")
    (store.data_dir(a) / "link").symlink_to(outside)
    store.delete(a)
    assert (outside / "keep").read_text() == "host file" and not store.data_dir(a).exists()
    assert store.records("pa") == [] and store.find("pb", "data")
    store.create("pa", VolumeCreate(name="data", size_mb=100), project_limit_mb=100)   # the name is free again
