"""Files by digest, bounded in size (least recently used go first), and what upstream said.

A file enters only through `put_file`, which hashes the bytes and refuses them unless they match
the digest asked for, so a name in the store is a promise about its bytes: whoever asked for
`sha256/<hex>` gets exactly those bytes, whichever sandbox or project caused the download.
Digests come from upstream index answers the cache fetched itself (`learn`) or from the
operator's seed; a sandbox can only name a digest, never supply bytes.

Layout under DSEC_HOME/pkgcache: files/<algo>/<2 hex>/<hex>, pkgcache.db (SQLite, WAL):
  blobs(algo, digest, size, used_at, pinned)  what is on disk; pinned: seeded, never evicted
  known(algo, digest, url, filename)           where upstream said a digest can be fetched
  pages(key, body, fetched_at)                 the last upstream index answer per page
  seeded(eco, project, filename, algo, digest, meta)  what a seed offers in index answers
  apt(url, sha256, kind, at)                   apt: the blob a mirror URL gives ('meta': its last
                                               fetch, refreshed after the TTL; 'deb': what a
                                               Packages index of that mirror named)
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ALGOS = ("sha256", "sha512")
USE_GRAIN_S = 60.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (algo TEXT, digest TEXT, size INTEGER NOT NULL, used_at REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (algo, digest));
CREATE INDEX IF NOT EXISTS blobs_lru ON blobs (pinned, used_at);
CREATE TABLE IF NOT EXISTS known (algo TEXT, digest TEXT, url TEXT NOT NULL, filename TEXT NOT NULL,
    PRIMARY KEY (algo, digest));
CREATE TABLE IF NOT EXISTS pages (key TEXT PRIMARY KEY, body BLOB NOT NULL, fetched_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS seeded (eco TEXT, project TEXT, filename TEXT, algo TEXT NOT NULL,
    digest TEXT NOT NULL, meta TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (eco, project, filename));
CREATE TABLE IF NOT EXISTS apt (url TEXT PRIMARY KEY, sha256 TEXT NOT NULL, kind TEXT NOT NULL, at REAL NOT NULL);
"""


class DigestMismatch(ValueError):
    """The bytes are not the ones the index named: never stored, never served."""


@dataclass(frozen=True)
class Seeded:
    filename: str
    algo: str
    digest: str
    meta: str


def valid_digest(algo: str, digest: str) -> bool:
    n = {"sha256": 64, "sha512": 128}.get(algo)
    return n is not None and len(digest) == n and all(c in "0123456789abcdef" for c in digest)


class BlobStore:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        (root / "files").mkdir(parents=True, exist_ok=True)
        (root / "tmp").mkdir(exist_ok=True)
        os.chmod(root, 0o700)   # the node's: sandboxes never see it (nothing binds it into one)
        self._db = sqlite3.connect(str(root / "pkgcache.db"), check_same_thread=False, isolation_level=None,
                                   timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")   # a lost last write costs a re-download, never bytes
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def path(self, algo: str, digest: str) -> Path:
        return self.root / "files" / algo / digest[:2] / digest

    # -- files -------------------------------------------------------------------------------
    def get(self, algo: str, digest: str) -> Path | None:
        """The file if held (and marks it used)."""
        if not valid_digest(algo, digest):
            return None
        p = self.path(algo, digest)
        rows = self._q("SELECT used_at FROM blobs WHERE algo=? AND digest=?", (algo, digest))
        if not rows or not p.exists():
            return None
        now = time.time()
        if now - rows[0][0] > USE_GRAIN_S:   # LRU to the minute: a hit is a read, not a write
            self._q("UPDATE blobs SET used_at=? WHERE algo=? AND digest=?", (now, algo, digest))
        return p

    def tmp_file(self) -> Path:
        return self.root / "tmp" / f"{os.getpid()}-{time.monotonic_ns()}"

    def put_file(self, algo: str, digest: str, src: Path, *, pinned: bool = False) -> Path:
        """Move `src` in as `algo/digest` if its bytes hash to it; else DigestMismatch (src removed)."""
        if not valid_digest(algo, digest):
            src.unlink(missing_ok=True)
            raise DigestMismatch(f"not a {algo} digest: {digest!r}")
        h = hashlib.new(algo)
        size = 0
        with open(src, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
        if h.hexdigest() != digest:
            src.unlink(missing_ok=True)
            raise DigestMismatch(f"{algo} of the bytes is {h.hexdigest()}, the index says {digest}")
        dst = self.path(algo, digest)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(src, 0o644)
        os.replace(src, dst)
        self._q("INSERT INTO blobs VALUES (?,?,?,?,?) ON CONFLICT (algo, digest) DO UPDATE SET "
                "used_at=excluded.used_at, pinned=max(pinned, excluded.pinned)",
                (algo, digest, size, time.time(), int(pinned)))
        self.evict()
        return dst

    def total_bytes(self) -> int:
        return int(self._q("SELECT coalesce(sum(size), 0) FROM blobs")[0][0])

    def evict(self) -> list[tuple[str, str]]:
        """Least recently used unpinned files out until the total is within max_bytes."""
        gone: list[tuple[str, str]] = []
        total = self.total_bytes()
        if total <= self.max_bytes:
            return gone
        for algo, digest, size in self._q("SELECT algo, digest, size FROM blobs WHERE pinned=0 ORDER BY used_at"):
            if total <= self.max_bytes:
                break
            self._q("DELETE FROM blobs WHERE algo=? AND digest=?", (algo, digest))
            self.path(algo, digest).unlink(missing_ok=True)
            total -= size
            gone.append((algo, digest))
        return gone

    # -- what upstream said ------------------------------------------------------------------
    def learn(self, entries: list[tuple[str, str, str, str]]) -> None:
        """(algo, digest, url, filename) from an upstream index answer: where to fetch a digest."""
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO known VALUES (?,?,?,?)", entries)

    def source_of(self, algo: str, digest: str) -> tuple[str, str] | None:
        rows = self._q("SELECT url, filename FROM known WHERE algo=? AND digest=?", (algo, digest))
        return (rows[0][0], rows[0][1]) if rows else None

    def save_page(self, key: str, body: bytes) -> None:
        """Kept index answers are bounded too (a tenth of the files' bound): oldest fetched go."""
        self._q("INSERT OR REPLACE INTO pages VALUES (?,?,?)", (key, body, time.time()))
        over = int(self._q("SELECT coalesce(sum(length(body)), 0) FROM pages")[0][0]) - self.max_bytes // 10
        for k, size in self._q("SELECT key, length(body) FROM pages WHERE key != ? ORDER BY fetched_at", (key,)):
            if over <= 0:
                break
            self._q("DELETE FROM pages WHERE key=?", (k,))
            over -= size

    def page(self, key: str) -> tuple[bytes, float] | None:
        rows = self._q("SELECT body, fetched_at FROM pages WHERE key=?", (key,))
        return (bytes(rows[0][0]), float(rows[0][1])) if rows else None

    # -- seeds -------------------------------------------------------------------------------
    def seed(self, eco: str, project: str, filename: str, algo: str, digest: str, meta: str = "{}") -> None:
        self._q("INSERT OR REPLACE INTO seeded VALUES (?,?,?,?,?,?)", (eco, project, filename, algo, digest, meta))

    def seeded(self, eco: str, project: str) -> list[Seeded]:
        return [Seeded(*r) for r in self._q("SELECT filename, algo, digest, meta FROM seeded WHERE eco=? AND project=? "
                                            "ORDER BY filename", (eco, project))]

    # -- apt ---------------------------------------------------------------------------------
    def apt_name(self, entries: list[tuple[str, str, str]], at: float | None = None) -> None:
        """(url, sha256, kind): the blob a mirror URL gives from now on."""
        t = time.time() if at is None else at
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO apt VALUES (?,?,?,?)", [(u, d, k, t) for u, d, k in entries])

    def apt_lookup(self, url: str) -> tuple[str, str, float] | None:
        rows = self._q("SELECT sha256, kind, at FROM apt WHERE url=?", (url,))
        return (rows[0][0], rows[0][1], float(rows[0][2])) if rows else None
