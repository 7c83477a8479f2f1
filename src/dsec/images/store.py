"""Layer store layout, the SQLite image registry, and the file lock both use.

Layout under a node's DSEC_HOME:
    store/<hex>.erofs        one file per layer, named by sha256 of its bytes
    store/.tmp-*.erofs       builds in progress (renamed into place when done)
    store/.lock              serialises "rename into place + register" against GC
    images.db                registry: layers, images, image_layers (ordered, base first)
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import sqlite3
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Sequence

from dsec.config import Paths
from dsec.types import Conflict, Forbidden, ImageInfo, InvalidArgument, LayerInfo, NAME_RE, NotFound

log = logging.getLogger("dsec.images")

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME_RE = re.compile(NAME_RE)
TMP_PREFIX = ".tmp-"


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def check_digest(digest: str, field: str = "digest") -> str:
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise InvalidArgument(f"{digest!r} is not a layer digest", field=field,
                              fix="use 'sha256:' followed by 64 lowercase hex digits, as listed by "
                                  "ImageService.get(name).layers")
    return digest


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(f"image name {name!r} is not valid", field="name",
                              fix="start with a letter or digit, then up to 127 of "
                                  "[A-Za-z0-9._@:+-], e.g. 'my-image' or 'py311:v2'")
    if name.startswith("sha256:"):
        raise InvalidArgument(f"image name {name!r} looks like a digest", field="name",
                              fix="pick a name that does not start with 'sha256:'")
    return name


def image_digest(layer_digests: Sequence[str]) -> str:
    """sha256 over the ordered layer digests, joined by newlines (base first)."""
    return "sha256:" + hashlib.sha256("\n".join(layer_digests).encode()).hexdigest()


def layer_file(paths: Paths, digest: str) -> Path:
    return paths.store / f"{check_digest(digest).split(':', 1)[1]}.erofs"


class FileLock:
    """Exclusive flock on a file: excludes other processes *and* other threads (each
    acquisition opens its own file description). Re-entrant within a thread."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._local = threading.local()

    def __enter__(self) -> "FileLock":
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._local.fd = fd
        self._local.depth = depth + 1
        return self

    def __exit__(self, *exc) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            fd, self._local.fd = self._local.fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS layers (
    digest      TEXT PRIMARY KEY,
    size_bytes  INTEGER NOT NULL,
    created_at  TEXT NOT NULL,
    source      TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS images (
    name        TEXT PRIMARY KEY,
    digest      TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS image_layers (
    name        TEXT NOT NULL REFERENCES images(name) ON DELETE CASCADE,
    position    INTEGER NOT NULL,
    layer       TEXT NOT NULL REFERENCES layers(digest),
    PRIMARY KEY (name, position)
);
CREATE INDEX IF NOT EXISTS image_layers_layer ON image_layers(layer);
-- layers attached by path by something that must find them again (a VM that resumes, a VM
-- snapshot that restores) after its image was rebuilt or removed: GC keeps them
CREATE TABLE IF NOT EXISTS layer_holds (
    holder      TEXT NOT NULL,
    layer       TEXT NOT NULL REFERENCES layers(digest),
    PRIMARY KEY (holder, layer)
);
CREATE INDEX IF NOT EXISTS layer_holds_layer ON layer_holds(layer);
CREATE INDEX IF NOT EXISTS images_digest ON images(digest);
"""


# A replaced image's layers stay (held, not GC'd) this long: a create that resolved the name
# just before the replace still finds and mounts them (issue 24: concurrent builds of a name)
REPLACED_GRACE_S = 300.0
REPLACED_PREFIX = "replaced:"


def check_may_replace(existing: ImageInfo, owner: str | None) -> None:
    """A project may write only names it owns (or new ones); the operator (None) any name."""
    if owner is not None and existing.owner != owner:
        raise Forbidden(f"image {existing.name!r} belongs to another project" if existing.owner
                        else f"image {existing.name!r} is published to all projects by the operator",
                        field="name", fix="pick another name (names are shared by all projects)")


class Registry:
    """Images and layers in SQLite (WAL). One short-lived connection per operation, so an
    instance can be shared by threads; writers use BEGIN IMMEDIATE."""

    def __init__(self, db_path: Path, keep_reader: bool = False):
        self.db_path = Path(db_path)
        self.keep_reader = keep_reader
        self._readers = threading.local()     # reader(): per thread, (file id, connection)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        with self.connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            cols = {r[1] for r in db.execute("PRAGMA table_info(images)")}
            # v1 -> v2: images and named layers share one namespace; v3: images have an owner
            # (a project; NULL = published to all: what the operator builds)
            for col, ddl in (("kind", "ALTER TABLE images ADD COLUMN kind TEXT NOT NULL DEFAULT 'image'"),
                             ("owner", "ALTER TABLE images ADD COLUMN owner TEXT")):
                if col not in cols:
                    try:
                        db.execute(ddl)
                    except sqlite3.OperationalError as e:   # another process migrated first
                        if "duplicate column" not in str(e):
                            raise
            db.execute("PRAGMA user_version=3")

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.db_path, timeout=60, isolation_level=None)
        try:
            db.execute("PRAGMA foreign_keys=ON")
            db.execute("PRAGMA busy_timeout=60000")
            yield db
        finally:
            db.close()

    @contextmanager
    def reader(self) -> Iterator[sqlite3.Connection]:
        """A connection for plain reads. With keep_reader (the long-lived server) it is kept,
        one per thread: opening one (and SQLite parsing the schema on its first statement)
        costs ~0.5 ms, 10x the queries, and every create resolves its image names on the
        apiserver's event loop (D42). Short-lived users open and close one as before, so no
        file of a home stays open after them (a home on its own mount can be unmounted)."""
        if not self.keep_reader:
            with self.connect() as db:
                yield db
            return
        st = os.stat(self.db_path)
        held: tuple[tuple[int, int], sqlite3.Connection] | None = getattr(self._readers, "held", None)
        if held is None or held[0] != (st.st_dev, st.st_ino):     # a new file at that path: reopen
            if held is not None:
                held[1].close()
            db = sqlite3.connect(self.db_path, timeout=60, isolation_level=None)
            db.execute("PRAGMA busy_timeout=60000")
            held = self._readers.held = ((st.st_dev, st.st_ino), db)
        yield held[1]

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # ---- reads -----------------------------------------------------------------------

    @staticmethod
    def _layer(row) -> LayerInfo:
        return LayerInfo(digest=row[0], size_bytes=row[1],
                         created_at=datetime.fromisoformat(row[2]), source=row[3])

    def get_layer(self, digest: str, db: sqlite3.Connection | None = None) -> LayerInfo | None:
        if db is None:
            with self.reader() as db:
                return self.get_layer(digest, db)
        row = db.execute("SELECT digest, size_bytes, created_at, source FROM layers WHERE digest=?",
                         (digest,)).fetchone()
        return self._layer(row) if row else None

    def _image(self, db: sqlite3.Connection, row) -> ImageInfo:
        name, digest, created, kind, owner = row
        layers = [self._layer(r) for r in db.execute(
            "SELECT l.digest, l.size_bytes, l.created_at, l.source FROM image_layers il "
            "JOIN layers l ON l.digest = il.layer WHERE il.name=? ORDER BY il.position", (name,))]
        return ImageInfo(name=name, digest=digest, layers=layers,
                         size_bytes=sum(lay.size_bytes for lay in layers),
                         created_at=datetime.fromisoformat(created), kind=kind, owner=owner)

    def get_image(self, name: str, db: sqlite3.Connection | None = None) -> ImageInfo | None:
        if db is None:
            with self.reader() as db:
                return self.get_image(name, db)
        row = db.execute("SELECT name, digest, created_at, kind, owner FROM images WHERE name=?", (name,)).fetchone()
        return self._image(db, row) if row else None

    def get_image_by_digest(self, digest: str) -> ImageInfo | None:
        with self.reader() as db:
            row = db.execute("SELECT name, digest, created_at, kind, owner FROM images WHERE digest=? "
                             "ORDER BY created_at, name LIMIT 1", (digest,)).fetchone()
            return self._image(db, row) if row else None

    def list_images(self) -> list[ImageInfo]:
        with self.connect() as db:
            rows = db.execute("SELECT name, digest, created_at, kind, owner FROM images ORDER BY name").fetchall()
            return [self._image(db, r) for r in rows]

    def image_names(self, limit: int = 1000) -> list[str]:
        with self.connect() as db:
            return [r[0] for r in db.execute("SELECT name FROM images ORDER BY name LIMIT ?", (limit,))]

    def layer_digests(self) -> set[str]:
        with self.connect() as db:
            return {r[0] for r in db.execute("SELECT digest FROM layers")}

    # ---- writes (callers hold the store lock) ------------------------------------------

    def put_image(self, db: sqlite3.Connection, name: str, layers: Sequence[LayerInfo], *,
                  replace: bool, kind: str = "image", owner: str | None = None) -> tuple[ImageInfo, bool]:
        """Register `name` -> layers inside the caller's transaction, owned by project `owner`
        (None: the operator, publishing to all projects).

        Returns (image, changed). Same name and same digest: the existing image, unchanged.
        Different digest: Conflict unless replace. A project never replaces (or takes over)
        a name that is not its own; the operator may replace anything."""
        digests = [lay.digest for lay in layers]
        digest = image_digest(digests)
        existing = self.get_image(name, db)
        if existing is not None:
            if existing.digest == digest:
                return existing, False
            if not replace:
                # another project's image: its digest is not the caller's to learn (issue 22)
                theirs = owner is not None and existing.owner != owner
                raise Conflict(
                    f"image {name!r} already exists" + ("" if theirs else f" with digest {existing.digest}; "
                                                        f"the new build has digest {digest}"), field="name",
                    fix="pick another name" if theirs else
                        "pass replace=True to point the name at the new build, or pick another name")
            check_may_replace(existing, owner)
            db.execute("DELETE FROM images WHERE name=?", (name,))
            # creates in flight may have resolved the old digest: its layers outlive it a while
            # (holder names sort by time: gc releases those past REPLACED_GRACE_S)
            holder = f"{REPLACED_PREFIX}{time.time():015.3f}:{existing.digest[7:23]}"
            db.executemany("INSERT OR IGNORE INTO layer_holds(holder, layer) VALUES (?,?)",
                           [(holder, lay.digest) for lay in existing.layers])
        for lay in layers:
            db.execute("INSERT OR IGNORE INTO layers(digest, size_bytes, created_at, source) "
                       "VALUES (?,?,?,?)",
                       (lay.digest, lay.size_bytes, lay.created_at.isoformat(), lay.source))
        db.execute("INSERT INTO images(name, digest, created_at, kind, owner) VALUES (?,?,?,?,?)",
                   (name, digest, now_utc().isoformat(), kind, owner))
        db.executemany("INSERT INTO image_layers(name, position, layer) VALUES (?,?,?)",
                       [(name, i, d) for i, d in enumerate(digests)])
        image = self.get_image(name, db)
        assert image is not None
        return image, True

    def set_owner(self, name: str, owner: str | None) -> ImageInfo:
        """Give image `name` to project `owner`, or publish it to all (None)."""
        with self.transaction() as db:
            if db.execute("UPDATE images SET owner=? WHERE name=?", (owner, name)).rowcount == 0:
                raise NotFound(f"no image {name!r}", field="name", fix="list images with `dsec image ls`")
            image = self.get_image(name, db)
        assert image is not None
        return image

    def delete_image(self, db: sqlite3.Connection, name: str) -> bool:
        return db.execute("DELETE FROM images WHERE name=?", (name,)).rowcount > 0

    def unreferenced_layers(self, db: sqlite3.Connection) -> list[str]:
        return [r[0] for r in db.execute(
            "SELECT digest FROM layers WHERE digest NOT IN (SELECT layer FROM image_layers) "
            "AND digest NOT IN (SELECT layer FROM layer_holds)")]

    # ---- holds: layers in use outside images (no store lock needed: holds and GC are write
    # transactions, so they are serialised, and a hold on a layer GC deleted is refused) -----

    def hold(self, holder: str, digests: Sequence[str]) -> None:
        with self.transaction() as db:
            for d in digests:
                if db.execute("SELECT 1 FROM layers WHERE digest=?", (d,)).fetchone() is None:
                    raise NotFound(f"layer {d} is no longer in the registry", field="layer",
                                   fix="its image was removed or rebuilt meanwhile: create the sandbox again")
                db.execute("INSERT OR IGNORE INTO layer_holds(holder, layer) VALUES (?,?)", (holder, d))

    def release(self, holder: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM layer_holds WHERE holder=?", (holder,))

    def holders(self, prefix: str = "") -> set[str]:
        with self.connect() as db:
            return {r[0] for r in db.execute("SELECT DISTINCT holder FROM layer_holds WHERE holder LIKE ? || '%'",
                                             (prefix,))}

    def release_replaced(self, db: sqlite3.Connection, grace_s: float) -> None:
        """Drop the holds on replaced images' layers older than grace_s (inside gc's transaction)."""
        db.execute("DELETE FROM layer_holds WHERE holder LIKE ? || '%' AND holder < ?",
                   (REPLACED_PREFIX, f"{REPLACED_PREFIX}{time.time() - grace_s:015.3f}"))

    def delete_layer(self, db: sqlite3.Connection, digest: str) -> None:
        db.execute("DELETE FROM layers WHERE digest=?", (digest,))
