"""Which crun binary the driver runs: the node's read-only bind of it when host set-up made one.

crun guards against CVE-2019-5736 (a container process rewriting the runtime's binary through
/proc/<pid>/exe) by re-executing itself, before every command, from a read-only bind of its own
binary in /tmp: a tmp file, two mounts, an unmount and a second exec with its dynamic loading.
It skips that when its binary is already on a read-only mount (its own check: fstatfs of
/proc/self/exe, ST_RDONLY), which is the same protection. scripts/host-setup.sh keeps such a bind
at RO_PATH; the driver uses it only while it is read-only and the same file as the crun it would
run (an upgraded crun is a new file: the stale bind is not used until host set-up rebinds it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RO_PATH = Path("/run/dsec/crun")


def crun_binary(crun: str = "crun", ro_path: Path = RO_PATH) -> str:
    path = shutil.which(crun) or crun
    try:
        ro, real = os.stat(ro_path), os.stat(path)
        if (ro.st_dev, ro.st_ino) != (real.st_dev, real.st_ino):
            return path
        if not os.statvfs(ro_path).f_flag & os.ST_RDONLY:
            return path
    except OSError:
        return path
    return str(ro_path)
