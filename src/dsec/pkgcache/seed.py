"""`dsec cache seed DIR`: the operator's wheels, sdists, npm tarballs and .debs into the store, pinned.

Pinned files are never evicted (the operator chose them; a node without outside access depends
on them) and are offered in index answers beside upstream's, so pip and npm find them when
upstream is down or absent. A project name is read from the file: a wheel's or sdist's name
(PEP 427 / 625), an npm tarball's package/package.json. A .deb is kept by its SHA256 and served
when a Packages index of the mirror asked names that SHA256; with `apt_mirror` (the http:// URL
sandboxes' sources name) DIR is a copy of that mirror (dists/ and pool/): its metadata is kept
as that mirror's answers (signed as upstream signed it: apt in the sandbox verifies it), so a
node without outside access serves `apt-get update && apt-get install` from it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

from dsec.pkgcache import apt
from dsec.pkgcache.index import integrity_of_sha512, npm_name, pypi_name
from dsec.pkgcache.store import BlobStore

SDIST_SUFFIXES = (".tar.gz", ".zip")


def _digest(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _pypi_project(name: str) -> str | None:
    if name.endswith(".whl"):
        return pypi_name(name.split("-", 1)[0])
    for sfx in SDIST_SUFFIXES:
        if name.endswith(sfx):
            return pypi_name(name[: -len(sfx)].rsplit("-", 1)[0])
    return None


def _npm_meta(path: Path) -> dict | None:
    try:
        with tarfile.open(path, "r:gz") as t:
            member = t.extractfile("package/package.json")
            doc = json.loads(member.read()) if member is not None else None
    except (tarfile.TarError, KeyError, OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not npm_name(str(doc.get("name", ""))) or not doc.get("version"):
        return None
    keep = ("name", "version", "dependencies", "optionalDependencies", "peerDependencies", "bin", "engines")
    return {k: doc[k] for k in keep if k in doc}


def seed_dir(store: BlobStore, directory: Path, apt_mirror: str = "") -> dict[str, list[str]]:
    """Every wheel/sdist (pypi), .tgz (npm) and .deb (apt) under `directory`, and with
    `apt_mirror` every file under directory/dists/ as that mirror's; returns what went where and
    what was skipped (with why)."""
    done: dict[str, list[str]] = {"pypi": [], "npm": [], "apt": [], "skipped": []}
    base = apt_mirror.rstrip("/") + "/" if apt_mirror else ""
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.name
        rel = path.relative_to(directory).as_posix()
        if base and rel.startswith("dists/"):
            _seed_apt_meta(store, path, base + rel)
            done["apt"].append(rel)
            continue
        if name.endswith(apt.DEB_SUFFIXES):
            digest = _digest(path, "sha256")
            _pin(store, path, "sha256", digest)
            done["apt"].append(rel)
            continue
        if name.endswith(".tgz"):
            meta = _npm_meta(path)
            if meta is None:
                done["skipped"].append(f"{path}: no package/package.json with a name and version")
                continue
            digest = _digest(path, "sha512")
            _pin(store, path, "sha512", digest)
            meta["dist"] = {"integrity": integrity_of_sha512(digest), "tarball": name}
            store.seed("npm", meta["name"], name, "sha512", digest, json.dumps(meta))
            done["npm"].append(f"{meta['name']}@{meta['version']}")
            continue
        project = _pypi_project(name)
        if project is None:
            done["skipped"].append(f"{path}: not a wheel, sdist (.tar.gz/.zip), npm tarball (.tgz) or .deb")
            continue
        digest = _digest(path, "sha256")
        _pin(store, path, "sha256", digest)
        store.seed("pypi", project, name, "sha256", digest)
        done["pypi"].append(name)
    return done


def _seed_apt_meta(store: BlobStore, path: Path, url: str) -> None:
    """A mirror's metadata file as the cache would have fetched it from `url` (pkgcache.py's
    _apt_meta): kept by content, named for the URL, its Release's and Packages' entries read."""
    digest = _digest(path, "sha256")
    _pin(store, path, "sha256", digest)
    mirror = apt.mirror_base(url)
    rows = [(url, digest, "meta")]
    if apt.is_release(url):
        rows += [(apt.index_key(mirror, d), d, "index") for d in apt.release_packages(path)]
    if apt.is_packages(url):
        rows += [(u, d, "deb") for u, d in apt.packages_entries(path, mirror)]
    store.apt_name(rows)


def _pin(store: BlobStore, path: Path, algo: str, digest: str) -> None:
    tmp = store.tmp_file()
    shutil.copyfile(path, tmp)
    store.put_file(algo, digest, tmp, pinned=True)
