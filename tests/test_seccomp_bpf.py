"""crun's compiled seccomp filter kept and handed back (D103, backends/container/seccomp_bpf.py):
after the first start, every sandbox's config carries the filter crun compiled for the node's
profile (annotation run.oci.seccomp_bpf_data), crun loads exactly those bytes, and the filter
still denies what the profile denies, in the agent's commands as before."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from dsec.backends.container.seccomp_bpf import ANNOTATION, STATE_FILE
from dsec.security.seccomp import seccomp_profile
from dsec.types import ContainerArgs


async def test_later_starts_load_the_filter_crun_compiled_first(server, client) -> None:
    home = Path(server.home)
    args = ContainerArgs(image="debian-python", memory_mb=256, labels={"test": "seccomp-bpf"})
    first = await client.create(args)
    second = await client.create(args)
    try:
        compiled = (home / "crun" / first.id / STATE_FILE).read_bytes()
        cfg = json.loads((home / "sb" / second.id / "config.json").read_text())
        # the profile stays in the config (what the filter is); crun loads the kept bytes
        assert cfg["linux"]["seccomp"] == seccomp_profile()
        assert base64.b64decode(cfg["annotations"][ANNOTATION]) == compiled
        assert (home / "crun" / second.id / STATE_FILE).read_bytes() == compiled
        r = await second.run("grep -E '^Seccomp(_filters)?:' /proc/self/status; unshare -U true; echo rc=$?; "
                             "python3 -c 'import ctypes; l=ctypes.CDLL(None, use_errno=True); "
                             "print(\"keyctl\", l.syscall(250, 0), ctypes.get_errno())'")
        assert "Seccomp:\t2" in r.stdout and "Seccomp_filters:\t1" in r.stdout, r.stdout
        assert "rc=1" in r.stdout and "Operation not permitted" in r.stderr, (r.stdout, r.stderr)
        assert "keyctl -1 1" in r.stdout, r.stdout          # EPERM, the profile's errnoRet
    finally:
        await first.stop()
        await second.stop()
