"""The volumes of a node (or of a cluster's shared store): one record file and one directory
per volume under the backend's volume root (backends.base.VolumeDirs).

    <root>/<id>.json   {id, name, project, size_mb, created_at}: written whole (rename)
    <root>/<id>/       the data, mounted into sandboxes

Records are files beside the data, not rows of the edge's database, so that nodes sharing one
root (DSEC_VOLUMES_DIR on a shared POSIX store) share the volumes; a flock on <root>/.lock
orders creates and deletes. A name is unique within its project; another project's volume
is never found by name (NotFound, as if it did not exist).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dsec.backends.base import VolumeDirs
from dsec.images.store import FileLock
from dsec.types import CapacityExceeded as QuotaExceeded, Conflict, NotFound, VolumeCreate, VolumeInfo


class VolumeStore:
    def __init__(self, dirs: VolumeDirs):
        self.dirs = dirs

    @property
    def root(self) -> Path:
        return self.dirs.volume_root()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with FileLock(self.root / ".lock"):
            yield

    def records(self, project: str | None = None) -> list[dict[str, Any]]:
        out = []
        if not self.root.is_dir():
            return out
        for p in sorted(self.root.glob("vol-*.json")):
            try:
                r = json.loads(p.read_text())
            except (OSError, ValueError):
                continue                      # being deleted, or not ours
            if project is None or r.get("project") == project:
                out.append(r)
        return out

    def find(self, project: str, name: str, field: str = "name") -> dict[str, Any]:
        for r in self.records(project):
            if r["name"] == name:
                return r
        raise NotFound(f"no volume {name!r} in project {project!r}", field=field,
                       fix="create it first (client.create_volume / `dsec volume create`); list them with "
                           "`dsec volume ls`")

    def data_dir(self, r: dict[str, Any]) -> Path:
        return self.root / r["id"]

    def create(self, project: str, req: VolumeCreate, project_limit_mb: int | None = None) -> dict[str, Any]:
        """A new volume; its size counts against the project's total (sizes are limits that
        the scratch overcommits, as disk_mb is: this bounds what one project can claim)."""
        with self._locked():
            mine = self.records(project)
            if any(r["name"] == req.name for r in mine):
                raise Conflict(f"project {project!r} already has a volume {req.name!r}", field="name",
                               fix="choose another name, or delete the existing volume first")
            held = sum(r["size_mb"] for r in mine)
            if project_limit_mb is not None and held + req.size_mb > project_limit_mb:
                raise QuotaExceeded(f"project {project!r} has {held} MiB of volumes; {req.size_mb} more would pass "
                                    f"its {project_limit_mb} MiB (DSEC_VOLUMES_PROJECT_GB)", field="size_mb",
                                    fix="delete volumes you no longer need, or ask the operator to raise "
                                        "DSEC_VOLUMES_PROJECT_GB")
            r = {"id": "vol-" + secrets.token_hex(8), "name": req.name, "project": project,
                 "size_mb": req.size_mb, "created_at": time.time()}
            self.dirs.make_volume_dir(self.data_dir(r), req.size_mb << 20)
            tmp = self.root / f".{r['id']}.tmp"
            tmp.write_text(json.dumps(r))
            os.chmod(tmp, 0o600)
            tmp.replace(self.root / f"{r['id']}.json")
            return r

    def delete(self, r: dict[str, Any]) -> None:
        """The record goes first (the name is free at once), then the data."""
        with self._locked():
            (self.root / f"{r['id']}.json").unlink(missing_ok=True)
        self.dirs.remove_volume_dir(self.data_dir(r))

    def usage(self, r: dict[str, Any]) -> int:
        return self.dirs.volume_usage(self.data_dir(r))

    def info(self, r: dict[str, Any], used: int | None = None) -> VolumeInfo:
        return VolumeInfo(id=r["id"], name=r["name"], project=r["project"], size_mb=r["size_mb"],
                          created_at=datetime.fromtimestamp(r["created_at"], timezone.utc), used_bytes=used,
                          enforced=self.dirs.volumes_enforced)
