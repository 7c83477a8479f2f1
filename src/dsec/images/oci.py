"""Import OCI images (an OCI layout directory, or a `docker save` archive) as EROFS layers.

Consecutive OCI layers are merged into one EROFS layer while their (blob) sizes add up to at
most `merge_bytes` (the brief: ~3 GB). Within a merged group the OCI whiteouts are *applied*
(`.wh.NAME` deletes NAME from earlier layers of the group, `.wh..wh..opq` empties the
directory of what earlier layers of the group put there). Above the first group they are
also *kept* as overlay semantics for the groups below: a whiteout becomes a char device 0/0,
an opaque marker (or a directory that replaces a deleted path) sets
`trusted.overlay.opaque=y`. mkfs.erofs keeps both, and overlayfs honours them in lower layers.
Per the OCI spec, a layer's whiteouts apply to the layers below it only, never to entries
of the same layer, so each layer is handled in two passes: deletions, then extraction.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dsec.types import InvalidArgument, Unavailable

from .unpack import LAYER_RULES, UPLOAD_RULES, bounded, clean_name, resolve_beneath, unpack_beneath

WH_PREFIX = ".wh."
WH_OPAQUE = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar",
               "application/vnd.oci.image.layer.v1.tar+gzip",
               "application/vnd.oci.image.layer.v1.tar+zstd",
               "application/vnd.docker.image.rootfs.diff.tar.gzip",
               "application/vnd.docker.image.rootfs.diff.tar")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
DEFAULT_MERGE_BYTES = 3 << 30


@dataclass(frozen=True)
class Blob:
    path: Path
    size: int
    digest: str | None = None


def _bad(field: str, src: Path, why: str, fix: str | None = None) -> InvalidArgument:
    return InvalidArgument(f"cannot import {src}: {why}", field=field,
                           fix=fix or ("pass an OCI image layout directory (oci-layout, index.json, "
                                       "blobs/), e.g. from `skopeo copy docker://IMG oci:DIR`"
                                       if field == "oci" else
                                       "pass a complete `docker save` archive"))


def _within(path: Path, root: Path, field: str, src: Path) -> Path:
    """path, refused when a link takes it outside the layout or archive (an upload may hold
    symlinks: a blob linked to a host file must not be read)."""
    if not path.resolve().is_relative_to(root.resolve()):
        raise _bad(field, src, f"{path.relative_to(root)} is a link out of the {field.replace('_', ' ')}",
                   fix="send the layout's files themselves, not links to them")
    return path


def _read_json(path: Path, field: str, src: Path) -> dict | list:
    _within(path, path.parent, field, src)
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise _bad(field, src, f"{path.name} is missing") from None
    except (OSError, ValueError) as e:
        raise _bad(field, src, f"{path.name} is not valid JSON ({e})") from None


def _blob(root: Path, digest: str, field: str, src: Path, verify: bool = True) -> Path:
    algo, _, hexd = str(digest).partition(":")
    if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise _bad(field, src, f"unsupported or malformed digest {digest!r}")
    p = _within(root / "blobs" / "sha256" / hexd, root, field, src)
    if not p.is_file():
        raise _bad(field, src, f"blob {digest} is missing")
    if verify:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(4 << 20):
                h.update(chunk)
        if h.hexdigest() != hexd:
            raise _bad(field, src, f"blob {digest} is corrupt or truncated (digest mismatch)")
    return p


def oci_layout_layers(layout: Path, ref: str | None = None) -> list[Blob]:
    """Layer blobs of the image in an OCI layout dir, base first (blobs verified)."""
    layout = Path(layout)
    if not layout.is_dir():
        raise _bad("oci", layout, "not a directory")
    if not (layout / "oci-layout").is_file():
        raise _bad("oci", layout, "no oci-layout file: not an OCI image layout")
    index = _read_json(layout / "index.json", "oci", layout)
    for _ in range(4):       # index -> (nested index ->) manifest
        manifests = index.get("manifests") if isinstance(index, dict) else None
        if not manifests:
            raise _bad("oci", layout, "the index lists no manifests")
        pick = manifests[0]
        if ref is not None:
            named = [m for m in manifests
                     if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref]
            if not named:
                raise _bad("oci", layout, f"no manifest named {ref!r}",
                           fix="use a ref listed in index.json (org.opencontainers.image.ref.name)")
            pick = named[0]
        else:
            for m in manifests:
                plat = m.get("platform") or {}
                if plat.get("os") == "linux" and plat.get("architecture") == "amd64":
                    pick = m
                    break
        doc = json.loads(_blob(layout, pick.get("digest", ""), "oci", layout).read_bytes())
        if pick.get("mediaType") in INDEX_TYPES or doc.get("mediaType") in INDEX_TYPES:
            index, ref = doc, None
            continue
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise _bad("oci", layout, f"manifest {pick.get('digest')} has no layers")
        out = []
        for lay in layers:
            mt = lay.get("mediaType", "")
            if mt not in LAYER_TYPES:
                raise _bad("oci", layout, f"unsupported layer media type {mt!r}",
                           fix="only (gzip/zstd) tar layers are supported; no encrypted or "
                               "foreign layers")
            p = _blob(layout, lay.get("digest", ""), "oci", layout)
            out.append(Blob(p, p.stat().st_size, lay["digest"]))
        return out
    raise _bad("oci", layout, "index nesting is too deep")


def docker_archive_layers(archive: Path, work: Path) -> list[Blob]:
    """Extract a `docker save` tarball under `work`; its layer tarballs, base first."""
    archive = Path(archive)
    dest = work / "archive"
    unpack_beneath(archive, dest, field="docker_archive", what="the docker archive",
                   rules=bounded(UPLOAD_RULES, archive))
    manifest = _read_json(dest / "manifest.json", "docker_archive", archive)
    if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict):
        raise _bad("docker_archive", archive, "manifest.json lists no image")
    out = []
    for rel in manifest[0].get("Layers") or []:
        p = (dest / rel).resolve()
        if not str(p).startswith(str(dest.resolve()) + "/") or not p.is_file():
            raise _bad("docker_archive", archive, f"layer {rel!r} is missing")
        out.append(Blob(p, p.stat().st_size))
    if not out:
        raise _bad("docker_archive", archive, "the image has no layers")
    return out


def group_layers(blobs: list[Blob], merge_bytes: int) -> list[list[Blob]]:
    """Consecutive layers, merged while their sizes add up to at most merge_bytes."""
    groups: list[list[Blob]] = []
    size = 0
    for b in blobs:
        if groups and size + b.size <= merge_bytes:
            groups[-1].append(b)
            size += b.size
        else:
            groups.append([b])
            size = b.size
    return groups


def _members(blob: Path, field: str, work: Path) -> tuple[list[tarfile.TarInfo], Path]:
    """Member list of a layer tarball (gzip/xz/bzip2/plain read directly, zstd decompressed
    to a scratch file). Returns (members, the file tar should extract)."""
    src = blob
    with open(blob, "rb") as f:
        magic = f.read(4)
    if magic == b"\x28\xb5\x2f\xfd":
        if shutil.which("zstd") is None:
            raise Unavailable("zstd layers need the zstd program", fix="apt-get install -y zstd")
        src = work / f"{blob.name}.tar"
        with open(src, "wb") as out:
            if subprocess.run(["zstd", "-dc", str(blob)], stdout=out,
                              stderr=subprocess.DEVNULL).returncode != 0:
                raise _bad(field, blob, "a zstd layer is corrupt or truncated")
    try:
        with tarfile.open(src, "r:*") as t:
            return t.getmembers(), src
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise _bad(field, blob, f"a layer tarball is corrupt or truncated ({e})") from None


def _norm(name: str, field: str, blob: Path) -> PurePosixPath | None:
    rel = clean_name(name, field=field, what=f"layer {blob.name}")
    return PurePosixPath(rel) if rel is not None else None


def _remove(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def apply_layer(blob: Path, root: Path, *, keep_whiteouts: bool, field: str, work: Path) -> None:
    """Apply one OCI layer tarball onto `root` (the group built so far)."""
    members, src = _members(blob, field, work)
    whiteouts: list[PurePosixPath] = []
    opaque: set[PurePosixPath] = set()
    # pass 1: deletions (whiteouts apply to earlier layers only) and type changes
    for m in members:
        rel = _norm(m.name, field, blob)
        if rel is None:
            continue
        base = rel.name
        if base == WH_OPAQUE:
            p = resolve_beneath(root, rel)       # links in its parent followed inside root
            if p is not None and p.parent.is_dir() and not p.parent.is_symlink():
                for child in list(os.scandir(p.parent)):
                    _remove(Path(child.path))
            if keep_whiteouts:
                opaque.add(rel.parent)
        elif base.startswith(WH_PREFIX):
            target = rel.parent / base[len(WH_PREFIX):]
            p = resolve_beneath(root, target)
            if p is not None:
                _remove(p)
            if keep_whiteouts:
                whiteouts.append(target)
        else:
            p = resolve_beneath(root, rel)
            if p is None:
                continue
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if m.isdir():
                if not stat.S_ISDIR(st.st_mode):
                    if keep_whiteouts and _is_whiteout(st):
                        opaque.add(rel)     # deleted below, re-created here: hide the old one
                    _remove(p)
            elif not m.islnk():
                _remove(p)                  # tar re-creates it (type may differ)
    unpack_beneath(src, root, field=field, what=f"layer {blob.name}", rules=bounded(LAYER_RULES, blob))
    for rel in whiteouts:
        p = resolve_beneath(root, rel)
        if p is None or os.path.lexists(p):
            continue                         # re-created by this layer, or under a non-dir
        os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(0, 0))
    for rel in opaque:
        marker = resolve_beneath(root, rel / WH_OPAQUE)      # the directory, links followed
        p = marker.parent if marker is not None else None
        if p is not None and p.is_dir() and not p.is_symlink():
            os.setxattr(p, OPAQUE_XATTR, b"y", follow_symlinks=False)
    if src != blob:
        src.unlink(missing_ok=True)
