"""The cluster secret (apiserver <-> edge authentication) as a file on each node, never an
actor argument (Ray keeps those, readable by anyone with Ray access, to restart the actor).

<node-homes>/cluster.secret, 0600, one secret a line: the first is the one this node's replicas
send, every line is one its edges accept. Readers stat it on every use and reread it when it
changed, so a rotation (`dsec cluster rotate-secret`, ray_cluster.rotate_secret) needs no
restart and drops no request: every node's file becomes [old, new] (edges accept both), then
[new, old] (replicas send the new one), then [new].
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dsec.types import Unavailable

SECRET_FILE = "cluster.secret"
MIN_LEN = 32


class SecretFile:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._key: tuple[int, int, int] | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def _load(self) -> list[str]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise Unavailable(f"the cluster secret file {self.path} is missing on this node", field="secret",
                              fix="run `dsec cluster up` (it installs the secret on every live node)") from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key != self._key:
                lines = [x.strip() for x in self.path.read_text().splitlines() if x.strip()]
                if not lines or any(len(x) < MIN_LEN for x in lines):
                    raise Unavailable(f"the cluster secret file {self.path} holds no valid secret", field="secret",
                                      fix="run `dsec cluster up` or `dsec cluster rotate-secret`")
                self._key, self._lines = key, lines
            return self._lines

    def current(self) -> str:
        """The secret to send."""
        return self._load()[0]

    def accepted(self) -> list[str]:
        """The secrets to accept."""
        return list(self._load())


def install(path: Path | str, lines: list[str]) -> None:
    """Write the file atomically (0600): readers see the old or the new one, whole."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(x + "\n" for x in lines))
    os.replace(tmp, p)
