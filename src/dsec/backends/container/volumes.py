"""Where a node's volumes live (dsec.volumes) and how their quota is kept.

Default: DSEC_HOME/sb/.volumes/<id>, on the sandboxes' btrfs scratch, each volume a subvolume
with a quota-group limit of its size (disk.py's mechanism): the kernel refuses writes beyond it
(EDQUOT), at no cost per write or per mount. Where the scratch is not btrfs, or DSEC_VOLUMES_DIR
names another directory (a shared POSIX store in a cluster), volumes are plain directories
measured when a sandbox mounts one: a volume over its size is refused at its next mount.

Files on a volume keep the ids they have inside sandboxes (uid 1000 on disk is uid 1000 in
every sandbox): each sandbox sees the volume through a mount idmapped with its own host range
(nsexec.c -l, spec.volume_mounts), as it sees the image layers; nothing is ever chowned.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsec.backends.base import VolumeDirs
from dsec.backends.container.disk import PolledQuotas
from dsec.config import Paths

VOLUMES_SUBDIR = ".volumes"     # in sb/: a dot name is never a sandbox id (the driver skips it)
# the volume's top directory belongs to the default sandbox user (uid/gid 1000, E2B's `user`);
# root in any sandbox may write there too
OWNER_ID = 1000


class ContainerVolumeDirs(VolumeDirs):
    paths: Paths
    disk: PolledQuotas
    volumes_dir: str            # DSEC_VOLUMES_DIR ("": in the scratch)

    @property
    def volumes_enforced(self) -> bool:     # type: ignore[override]
        return not self.volumes_dir and self.disk.enforced

    def volume_root(self) -> Path:
        return Path(self.volumes_dir) if self.volumes_dir else self.paths.sandboxes / VOLUMES_SUBDIR

    def make_volume_dir(self, d: Path, limit_bytes: int) -> None:
        d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.volumes_enforced:
            self.disk.create_dir(d, limit_bytes)      # a subvolume with its qgroup limit
        else:
            d.mkdir(mode=0o700)
        try:
            os.chown(d, OWNER_ID, OWNER_ID)
            os.chmod(d, 0o755)
        except BaseException:
            self.remove_volume_dir(d)
            raise

    def remove_volume_dir(self, d: Path) -> None:
        if self.volumes_enforced:
            self.disk.remove_dir(d)
        else:
            PolledQuotas.remove_dir(self.disk, d)       # rmtree: never follows symlinks

    def volume_usage(self, d: Path) -> int:
        return PolledQuotas.usage(d)
