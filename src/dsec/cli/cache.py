"""`dsec cache`: the node's package cache (issue 25.4), run on the node as the server's user."""

from __future__ import annotations

from pathlib import Path

import typer

from dsec.cli.common import _fail, _settings, console
from dsec.types import InvalidArgument

cache_app = typer.Typer(no_args_is_help=True, help="the node's package cache for pip and npm (seed it, see its size)")


def _store():
    from dsec.pkgcache.store import BlobStore
    s = _settings()
    return BlobStore(s.paths.home / "pkgcache", s.network.pkgcache_max_bytes)


@cache_app.command("seed")
def seed(directory: Path) -> None:
    """Add every wheel, sdist (.tar.gz/.zip) and npm tarball (.tgz) under DIRECTORY, pinned: the
    cache offers them in index answers even when upstream is down or unreachable."""
    from dsec.pkgcache.seed import seed_dir
    if not directory.is_dir():
        _fail(InvalidArgument(f"{directory} is not a directory", field="DIRECTORY",
                              fix="name a directory of wheels, sdists or .tgz files"))
    store = _store()
    try:
        console.print_json(data=seed_dir(store, directory))
    finally:
        store.close()


@cache_app.command("info")
def info() -> None:
    """Bytes held and the bound (DSEC_PKGCACHE_MAX_BYTES)."""
    store = _store()
    try:
        console.print_json(data={"bytes": store.total_bytes(), "max_bytes": store.max_bytes, "path": str(store.root)})
    finally:
        store.close()
