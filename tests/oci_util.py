"""Hand-made OCI image layouts and `docker save` archives (no registry is reachable here):
shared by the OCI import tests and the image containment tests."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

MT = 1_700_000_000


def layer_tar(entries: list[tuple[str, str | None]]) -> bytes:
    """entries: (name, text) files, (name/, None) dirs; order kept."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, text in entries:
            ti = tarfile.TarInfo(name.rstrip("/"))
            ti.mtime = MT
            if text is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                t.addfile(ti)
            else:
                data = text.encode()
                ti.size, ti.mode = len(data), 0o644
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def write_oci(root: Path, layers: list[bytes], *, gz: bool = True) -> Path:
    (root / "blobs" / "sha256").mkdir(parents=True)

    def put(data: bytes) -> tuple[str, int]:
        d = hashlib.sha256(data).hexdigest()
        (root / "blobs" / "sha256" / d).write_bytes(data)
        return "sha256:" + d, len(data)

    descs = []
    for lay in layers:
        data = gzip.compress(lay, mtime=0) if gz else lay
        d, n = put(data)
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else ""),
                      "digest": d, "size": n})
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                      "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    cd, cn = put(cfg)
    man = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                 "digest": cd, "size": cn}, "layers": descs}).encode()
    md, mn = put(man)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
         "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}))
    return root


def write_docker_archive(path: Path, layers: list[bytes]) -> Path:
    with tarfile.open(path, "w") as t:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), MT
            t.addfile(ti, io.BytesIO(data))
        names = []
        for i, lay in enumerate(layers):
            names.append(f"{i:064x}/layer.tar")
            add(names[-1], lay)
        add("config.json", b"{}")
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["x:1"],
                                          "Layers": names}]).encode())
    return path


def member(name: str, kind: str = "file", data: bytes = b"", *, link: str = "", mode: int = 0o644,
           uid: int = 0, xattrs: dict[str, str] | None = None) -> tuple[tarfile.TarInfo, bytes | None]:
    """One tar member: kind file, dir, symlink, hardlink, chr (1:3), blk (8:0) or fifo."""
    ti = tarfile.TarInfo(name)
    ti.mtime, ti.mode, ti.uid, ti.gid = MT, mode, uid, uid
    types = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
             "hardlink": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE,
             "fifo": tarfile.FIFOTYPE}
    ti.type = types[kind]
    ti.linkname = link
    if kind == "chr":
        ti.devmajor, ti.devminor = 1, 3
    elif kind == "blk":
        ti.devmajor, ti.devminor = 8, 0
    if xattrs:
        ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
    if kind == "file":
        ti.size = len(data)
        return ti, data
    return ti, None


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """A layer tarball of `member(...)`s, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()
