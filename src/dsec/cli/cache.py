"""`dsec cache`: the node's package cache (issue 25.4), run on the node as the server's user."""

from __future__ import annotations

from pathlib import Path

import typer

from dsec.cli.common import _fail, _settings, console
from dsec.types import InvalidArgument

cache_app = typer.Typer(no_args_is_help=True, help="the node's package cache for pip, npm and apt (seed it, see its size)")


def _store():
    from dsec.pkgcache.store import BlobStore
    s = _settings()
    return BlobStore(s.paths.home / "pkgcache", s.network.pkgcache_max_bytes)


@cache_app.command("seed")
def seed(directory: Path,
         apt_mirror: str = typer.Option("", "--apt-mirror", help="DIRECTORY is a copy of this http:// apt "
                                        "mirror (its dists/ and pool/), e.g. http://deb.debian.org/debian")) -> None:
    """Add every wheel, sdist (.tar.gz/.zip), npm tarball (.tgz) and .deb under DIRECTORY, pinned: the
    cache offers them in index answers even when upstream is down or unreachable (a .deb when
    a Packages index names its SHA256: the mirror's own, or the copy given with --apt-mirror)."""
    from dsec.pkgcache.seed import seed_dir
    if not directory.is_dir():
        _fail(InvalidArgument(f"{directory} is not a directory", field="DIRECTORY",
                              fix="name a directory of wheels, sdists, .tgz or .deb files"))
    if apt_mirror and (not apt_mirror.startswith("http://") or "@" in apt_mirror or "?" in apt_mirror):
        _fail(InvalidArgument(f"--apt-mirror must be an http:// mirror URL, got {apt_mirror!r}", field="--apt-mirror",
                              fix="the URL sandboxes' sources.list names, e.g. http://deb.debian.org/debian "
                                  "(https mirrors are not proxied by the cache)"))
    if apt_mirror and not (directory / "dists").is_dir():
        _fail(InvalidArgument(f"{directory} has no dists/ directory", field="DIRECTORY",
                              fix="with --apt-mirror, DIRECTORY is a copy of the mirror: dists/ and pool/"))
    store = _store()
    try:
        console.print_json(data=seed_dir(store, directory, apt_mirror))
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
