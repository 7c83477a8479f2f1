"""ImageService: build, register, look up, mount and remove images on one node.

An image is an ordered list of EROFS layers, base first (for now every build makes a
single-layer image). Layer files are content-addressed in Paths.store; the registry is
SQLite at Paths.images_db; mounts are per node under Paths.layer_mounts. With a layer store
shared by all nodes (DSEC_LAYER_STORE, shared.py) builds are published to it, and a name this
node does not know is looked up there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from dsec.config import Paths
from dsec.settings import ImageSettings
from dsec.types import NAME_RE, Conflict, DsecError, ImageInfo, InvalidArgument, LayerInfo, NotFound

from .builder import (check_debootstrap_args, debootstrap_cached,
                      extract_tarball, safe_rmtree, scratch_dir, tree_size)
from .erofs import check_compression, mkfs, sha256_file
from .oci import (DEFAULT_MERGE_BYTES, apply_layer, docker_archive_layers, group_layers,
                  oci_layout_layers)
from .lazy import LazyView, lazy_enabled, manifest_file, meta_file, write_manifest
from .layers import _scrubbed, check_layer_name, chown_tree, copy_upper, git_archive, parse_owner
from .mounts import LayerMounts, mounts_under
from .progress import Progress, report
from .pull import check_ref, pull_to_layout
from .shared import SharedStore
from .uploads import UploadLedger
from . import store
from .store import (DIGEST_RE, TMP_PREFIX, FileLock, Registry, check_digest, check_may_replace, check_name,
                    layer_file, now_utc)

log = logging.getLogger("dsec.images")

_LAYER_FILE_RE = re.compile(r"^[0-9a-f]{64}\.erofs$")
_NAME_OK = re.compile(NAME_RE)
SPARSE_CHUNK = 4096     # chunk size of layers holding sparse files (erofs.mkfs)
STALE_TEMP_S = 24 * 3600
T = TypeVar("T")


def _lower_priority() -> None:
    """Heavy workers (and the mkfs.erofs they start) yield the CPU to creations and execs."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass


class HeavyWork:
    """The node's bounded lane for heavy image work started through the API (pack_diff: a
    walk and copy of the upper dir, mkfs.erofs, hashing; seconds to minutes). It has its own
    threads (DSEC_HEAVY_PARALLEL, default half the cores, at least 2; niced), so it never
    takes the default thread pool that sandbox creation and the request paths run on; work
    beyond the limit waits for a `slot()` before it starts (a waiting pack_diff leaves its
    sandbox running: it freezes the sandbox only once it has the slot)."""

    def __init__(self, workers: int = 0):
        self.workers = workers or max(2, (os.cpu_count() or 2) // 2)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="dsec-heavy", initializer=_lower_priority)
        self._slots: asyncio.Semaphore | None = None
        # one project never holds every slot: another's pack_diff or build always gets one
        self.per_project = max(1, self.workers - 1)
        self._theirs: dict[str, asyncio.Semaphore] = {}

    @asynccontextmanager
    async def slot(self, project: str | None = None) -> AsyncIterator[None]:
        """A heavy-work slot; `project`'s own work holds at most `per_project` of them (it waits
        for its own first, so it never blocks the node's slots while it queues)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        if project is None:
            async with self._slots:
                yield
            return
        mine = self._theirs.setdefault(project, asyncio.Semaphore(self.per_project))
        async with mine, self._slots:
            yield

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a heavy worker (queued there when all are busy)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))


class ImageService:
    def __init__(self, paths: Paths, keep_reader: bool = False, settings: ImageSettings | None = None):
        self.paths = paths
        self.settings = settings or ImageSettings()   # the composition root's (dsec.settings)
        for d in (self.paths.home, self.paths.store, self.paths.layer_mounts):
            d.mkdir(parents=True, exist_ok=True)
        # keep_reader: the server's own instance keeps a read connection per thread (D42)
        self.registry = Registry(self.paths.images_db, keep_reader=keep_reader)
        # DSEC_LAYER_STORE: the layer store shared by all nodes (publish to it, fetch from it)
        self.shared = SharedStore(self.settings.layer_store, self.paths, timeout_s=self.settings.layer_store_timeout_s) \
            if self.settings.layer_store else None
        self._fetch_lock = threading.Lock()
        # DSEC_LAZY=1 (the default with a shared store): mount layers through the node's lazy
        # FUSE view; without it a layer built elsewhere is pulled whole before its mount
        self.lazy = LazyView(self.paths, remote=self.shared.url if self.shared else "", settings=self.settings) \
            if lazy_enabled(self.settings) else None
        self.mounts = LayerMounts(self.paths, source=self._shared_source if self.shared else
                                  self.lazy.source if self.lazy else None)
        self._store_lock = FileLock(self.paths.store / ".lock")
        self.heavy = HeavyWork(self.settings.heavy_parallel)
        self.uploads = UploadLedger(self.paths.home)     # what uploads in flight hold, per project
        self._sweep_stale_temps()

    # ---- building --------------------------------------------------------------------

    def build_from_dir(self, name: str, path: str | os.PathLike, *, replace: bool = False,
                       compression: str | None = None, source: str | None = None,
                       progress: Progress | None = None, kind: str = "image") -> ImageInfo:
        """Build a one-layer image from a directory tree (owners, modes, xattrs, mtimes kept)."""
        check_name(name)
        check_compression(compression)
        src = Path(path)
        if not src.is_dir():
            raise InvalidArgument(f"{src} is not a directory", field="path",
                                  fix="pass the root directory of the filesystem tree to pack")
        src = src.resolve()
        nested = [m.mountpoint for m in mounts_under(src) if m.mountpoint != str(src)]
        if nested:
            raise InvalidArgument(
                f"{src} has filesystems mounted inside it ({', '.join(nested[:3])}); they would be "
                "packed into the image", field="path",
                fix="unmount them (e.g. proc, sys, dev) or build from a copy of the tree")
        return self._build(name, src, source or f"dir:{src}", replace=replace,
                           compression=compression, progress=progress, kind=kind)

    def build_from_tar(self, name: str, tarball: str | os.PathLike, *, replace: bool = False,
                       compression: str | None = None,
                       customize: Callable[[Path], None] | None = None,
                       progress: Progress | None = None) -> ImageInfo:
        """Build a one-layer image from a rootfs tarball (.tar, .tar.gz, .tar.zst, .tar.xz)."""
        check_name(name)
        check_compression(compression)
        tarball = Path(tarball).absolute()
        with scratch_dir(self.paths, "tar") as work:
            root = work / "rootfs"
            extract_tarball(tarball, root, progress=progress)
            if customize is not None:
                customize(root)
            return self._build(name, root, f"tar:{tarball}", replace=replace,
                               compression=compression, progress=progress)

    def build_debootstrap(self, name: str, suite: str = "bookworm", include: Sequence[str] = (),
                          *, mirror: str | None = None, replace: bool = False,
                          compression: str | None = None,
                          customize: Callable[[Path], None] | None = None, cache: bool = True,
                          progress: Progress | None = None) -> ImageInfo:
        """Build a one-layer image with `debootstrap --variant=minbase`. The debootstrap tree
        is cached as a tarball under Paths.home/cache/ (keyed by suite + packages), so a
        rebuild skips the download; `customize(rootfs_dir)` runs on every build."""
        check_name(name)
        check_compression(compression)
        pkgs = check_debootstrap_args(suite, include)
        mirror = mirror or self.settings.debian_mirror
        with scratch_dir(self.paths, "debootstrap") as work:
            root = work / "rootfs"
            debootstrap_cached(self.paths, root, suite, pkgs, mirror=mirror, cache=cache,
                               progress=progress)
            if customize is not None:
                customize(root)
            source = f"debootstrap:{suite}" + (f"+{','.join(pkgs)}" if pkgs else "")
            return self._build(name, root, source, replace=replace, compression=compression,
                               progress=progress)

    # ---- named layers (workspaces, toolkits) ---------------------------------------------

    def build_layer(self, name: str, *, from_dir: str | os.PathLike | None = None,
                    from_tar: str | os.PathLike | None = None,
                    from_git: str | os.PathLike | None = None, rev: str = "HEAD",
                    prefix: str = "", chown: str | None = None, replace: bool = False,
                    compression: str | None = None,
                    progress: Progress | None = None) -> ImageInfo:
        """Build layer NAME@VERSION (kind 'layer') from exactly one of a directory, a tarball
        or a git checkout (`git archive REV`, files under `prefix`). `chown` ('UID[:GID]')
        gives every entry that owner (git archives are root-owned otherwise)."""
        check_layer_name(name)
        check_compression(compression)
        owner = parse_owner(chown)
        given = [x for x in (from_dir, from_tar, from_git) if x is not None]
        if len(given) != 1:
            raise InvalidArgument("give exactly one layer source", field="source",
                                  fix="pass one of from_dir, from_tar, from_git")
        with scratch_dir(self.paths, "layer") as work:
            root = work / "rootfs"
            if from_dir is not None:
                src = Path(from_dir)
                if not src.is_dir():
                    raise InvalidArgument(f"{src} is not a directory", field="from_dir",
                                          fix="pass the directory whose tree becomes the layer")
                if owner is None:
                    return self.build_from_dir(name, src, replace=replace, compression=compression,
                                               progress=progress, kind="layer")
                copy_upper(src.resolve(), root)
                source = f"dir:{src.resolve()}"
            elif from_tar is not None:
                extract_tarball(Path(from_tar).absolute(), root, progress=progress)
                source = f"tar:{Path(from_tar).absolute()}"
            else:
                repo = Path(from_git).resolve()     # type: ignore[arg-type]
                tar = work / "git.tar"
                git_archive(repo, tar, rev, prefix)
                extract_tarball(tar, root, progress=progress)
                source = f"git:{repo}@{rev}"
            if owner is not None:
                chown_tree(root, *owner)
            return self._build(name, root, source, replace=replace, compression=compression,
                               progress=progress, kind="layer")

    def pack_upper(self, name: str, upper: Path, *, parents: Sequence[ImageInfo] = (),
                   scrub: Sequence[str] = (), source: str, replace: bool = False,
                   progress: Progress | None = None,
                   map_id: Callable[[int], int] | None = None,
                   max_bytes: int | None = None, owner: str | None = None,
                   below: Sequence[tuple[Path, Callable[[int], int] | None]] = ()) -> ImageInfo:
        """pack_diff: turn an overlay upper dir (whiteouts and opaque dirs included) into a
        new layer NAME@VERSION stacked on the layers of `parents` (e.g. the workspace the
        sandbox started from). Paths matching `scrub` are left out. `map_id`: host id ->
        layer id (a user-namespaced sandbox's upper holds shifted host ids). `below`: more
        upper dirs between the parents and `upper` (a fork's snapshot layers, oldest first,
        each with its own map_id), each packed as a layer of its own.
        Sparse files stay sparse (in the copy and, as chunks, in the layer); `max_bytes` (the
        sandbox's disk quota) bounds the files' apparent size, holes included: what the layer
        hands a reader and what building it reads. Beyond it nothing is written. `owner`: the
        sandbox's project, which owns the layer (and must own the name if it exists)."""
        check_layer_name(name)
        existing = self.registry.get_image(name) if replace else None
        if existing is not None:
            check_may_replace(existing, owner)   # before any work; put_image checks again atomically
        if not Path(upper).is_dir():
            raise NotFound(f"no writable layer at {upper}", field="sandbox_id",
                           fix="pack_diff needs a running sandbox")
        scrub = list(scrub)
        if below:
            return self._pack_stacked(name, [*below, (Path(upper), map_id)], parents=parents, scrub=scrub,
                                      source=source, replace=replace, progress=progress, max_bytes=max_bytes,
                                      owner=owner)
        size = tree_size(Path(upper), lambda rel: _scrubbed(rel, scrub))
        if max_bytes is not None and size.apparent > max_bytes:
            big = ", ".join(f"{p} {b >> 20} MiB" for p, b in size.biggest)
            raise InvalidArgument(
                f"pack_diff {name}: the changes hold {size.apparent >> 20} MiB of files (holes of sparse "
                f"files included; {size.data >> 20} MiB allocated), more than the sandbox's "
                f"disk_mb={max_bytes >> 20} that bounds a layer; largest: {big}", field="disk_mb",
                fix="delete or truncate the big files (or leave them out with scrub=[...]), or pack a "
                    "sandbox created with a larger disk_mb")
        with scratch_dir(self.paths, "diff") as work:
            root = work / "rootfs"
            n = copy_upper(Path(upper), root, scrub, map_id)
            log.info("pack_diff %s: %d entries from %s (%d MiB, %d MiB allocated)", name, n, upper,
                     size.apparent >> 20, size.data >> 20)
            inherited = [lay for p in parents for lay in p.layers]
            return self._build(name, root, source, replace=replace, compression=None,
                               progress=progress, kind="layer", parents=inherited,
                               chunk_size=SPARSE_CHUNK if size.sparse else None, owner=owner)

    def import_oci(self, name: str, *, oci: str | os.PathLike | None = None,
                   docker_archive: str | os.PathLike | None = None, ref: str | None = None,
                   merge_bytes: int = DEFAULT_MERGE_BYTES, replace: bool = False,
                   compression: str | None = None,
                   progress: Progress | None = None, source: str | None = None) -> ImageInfo:
        """Import an image from an OCI layout directory or a `docker save` archive. Runs of
        consecutive OCI layers up to `merge_bytes` become one EROFS layer each (whiteouts
        kept as overlay whiteouts/opaque dirs between them). All or nothing: on any error
        nothing is registered and no layer file is left in the store."""
        check_name(name)
        check_compression(compression)
        if (oci is None) == (docker_archive is None):
            raise InvalidArgument("give exactly one of oci and docker_archive", field="source",
                                  fix="pass an OCI layout dir (oci=) or a docker-archive tar")
        if not isinstance(merge_bytes, int) or merge_bytes <= 0:
            raise InvalidArgument(f"bad merge_bytes {merge_bytes!r}", field="merge_bytes",
                                  fix="a positive size in bytes, e.g. 3<<30")
        field = "oci" if oci is not None else "docker_archive"
        src = Path(oci if oci is not None else docker_archive).absolute()  # type: ignore[arg-type]
        t0 = time.monotonic()
        tmps: list[Path] = []
        try:
            with scratch_dir(self.paths, "oci") as work:
                blobs = (oci_layout_layers(src, ref) if oci is not None
                         else docker_archive_layers(src, work))
                groups = group_layers(blobs, merge_bytes)
                layers: list[tuple[LayerInfo, Path | None]] = []
                for gi, group in enumerate(groups):
                    root = work / f"g{gi}"
                    root.mkdir(mode=0o755)
                    for bi, blob in enumerate(group):
                        report(progress, f"applying layer {bi + 1}/{len(group)} of group "
                                         f"{gi + 1}/{len(groups)}", None, level=logging.INFO)
                        apply_layer(blob.path, root, keep_whiteouts=gi > 0, field=field,
                                    work=work)
                    tmp = self.paths.store / f"{TMP_PREFIX}{secrets.token_hex(8)}.erofs"
                    tmps.append(tmp)
                    mkfs(root, tmp, compression=compression, progress=progress)
                    with open(tmp, "rb") as f:
                        os.fsync(f.fileno())
                    safe_rmtree(root)
                    digest = sha256_file(tmp, progress=progress)
                    layers.append((LayerInfo(digest=digest, size_bytes=tmp.stat().st_size,
                                             created_at=now_utc(),
                                             source=f"{source or f'{field}:{src}'}#{gi}:"
                                                    f"{len(group)} layer(s)"),
                                   tmp))
                image = self._commit(name, layers, replace=replace)
        finally:
            for t in tmps:
                for f in (t, manifest_file(t), meta_file(t)):
                    f.unlink(missing_ok=True)
        log.info("imported %s from %s: %d OCI layer(s) -> %d EROFS layer(s) in %.1fs", name, src,
                 len(blobs), len(groups), time.monotonic() - t0)
        return image

    def pull(self, name: str, ref: str, *, tls_verify: bool = True, creds: str | None = None,
             merge_bytes: int = DEFAULT_MERGE_BYTES, replace: bool = False,
             compression: str | None = None, progress: Progress | None = None) -> ImageInfo:
        """Pull `ref` (docker://HOST/REPO:TAG) from a registry with skopeo into a scratch OCI
        layout, then import it like import_oci (same merging, all or nothing)."""
        check_name(name)
        check_ref(ref)
        with scratch_dir(self.paths, "pull") as work:
            report(progress, f"skopeo copy {ref}", None, level=logging.INFO)
            layout, tag = pull_to_layout(ref, work / "layout", tls_verify=tls_verify, creds=creds)
            return self.import_oci(name, oci=layout, ref=tag, merge_bytes=merge_bytes,
                                   replace=replace, compression=compression, progress=progress,
                                   source=ref)

    def _pack_stacked(self, name: str, uppers: Sequence[tuple[Path, Callable[[int], int] | None]], *,
                      parents: Sequence[ImageInfo], scrub: list[str], source: str, replace: bool,
                      progress: Progress | None, max_bytes: int | None, owner: str | None) -> ImageInfo:
        """pack_upper of several upper dirs (oldest first): one new layer each, committed as one
        image (all or nothing). `max_bytes` bounds each layer as it bounds a single one."""
        tmps: list[Path] = []
        new: list[tuple[LayerInfo, Path | None]] = []
        try:
            for i, (up, mid) in enumerate(uppers):
                size = tree_size(up, lambda rel: _scrubbed(rel, scrub))
                if max_bytes is not None and size.apparent > max_bytes:
                    raise InvalidArgument(
                        f"pack_diff {name}: layer {i} holds {size.apparent >> 20} MiB of files, more than the "
                        f"sandbox's disk_mb={max_bytes >> 20} that bounds a layer", field="disk_mb",
                        fix="delete or truncate big files (or leave them out with scrub=[...])")
                tmp = self.paths.store / f"{TMP_PREFIX}{secrets.token_hex(8)}.erofs"
                tmps.append(tmp)
                with scratch_dir(self.paths, "diff") as work:
                    copy_upper(up, work / "rootfs", scrub, mid)
                    mkfs(work / "rootfs", tmp, compression=None, progress=progress,
                         chunk_size=SPARSE_CHUNK if size.sparse else None)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                new.append((LayerInfo(digest=sha256_file(tmp, progress=progress), size_bytes=tmp.stat().st_size,
                                      created_at=now_utc(), source=f"{source}:layer{i}"), tmp))
            inherited: list[tuple[LayerInfo, Path | None]] = [(lay, None) for p in parents for lay in p.layers]
            return self._commit(name, [*inherited, *new], replace=replace, kind="layer", owner=owner)
        finally:
            for tmp in tmps:
                for f in (tmp, manifest_file(tmp), meta_file(tmp)):
                    f.unlink(missing_ok=True)

    def _build(self, name: str, root: Path, source: str, *, replace: bool,
               compression: str | None, progress: Progress | None, kind: str = "image",
               parents: Sequence[LayerInfo] = (), chunk_size: int | None = None,
               owner: str | None = None) -> ImageInfo:
        t0 = time.monotonic()
        tmp = self.paths.store / f"{TMP_PREFIX}{secrets.token_hex(8)}.erofs"
        try:
            mkfs(root, tmp, compression=compression, progress=progress, chunk_size=chunk_size)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            digest = sha256_file(tmp, progress=progress)
            layer = LayerInfo(digest=digest, size_bytes=tmp.stat().st_size, created_at=now_utc(),
                              source=source)
            image = self._commit(name, [*((p, None) for p in parents), (layer, tmp)],
                                 replace=replace, kind=kind, owner=owner)
        finally:
            for f in (tmp, manifest_file(tmp), meta_file(tmp)):
                f.unlink(missing_ok=True)
        report(progress, f"image {name} = {image.digest[:19]} ({image.size_bytes} bytes) in "
                         f"{time.monotonic() - t0:.1f}s", 1.0, level=logging.INFO)
        return image

    def _commit(self, name: str, layers: Sequence[tuple[LayerInfo, Path | None]], *,
                replace: bool, kind: str = "image", owner: str | None = None) -> ImageInfo:
        """Move new layer files into place and register the image, atomically: on any
        failure the registry is unchanged and no new layer file is left in the store.
        With a shared store the layers are published first (outside the store lock: uploads
        take a while), the image record once the image is registered here."""
        for lay, tmp in layers:
            src = layer_file(self.paths, lay.digest)
            src = src if src.exists() or tmp is None else tmp
            if src.exists() and not manifest_file(src).exists():
                write_manifest(src)      # per-chunk digests for lazy loading
        pins = {lay.digest: self.shared.publish_layer(lay.digest, self._publish_source(lay.digest, tmp))
                for lay, tmp in layers} if self.shared else {}
        added: list[Path] = []
        with self._store_lock:
            try:
                with self.registry.transaction() as db:
                    image, changed = self.registry.put_image(db, name, [lay for lay, _ in layers],
                                                             replace=replace, kind=kind, owner=owner)
                    if changed:
                        for lay, tmp in layers:
                            final = layer_file(self.paths, lay.digest)
                            if final.exists():
                                continue          # dedup: same bytes already stored
                            if tmp is None and self.shared is not None and manifest_file(final).exists():
                                continue          # its bytes are in the shared store
                            if tmp is None:
                                raise NotFound(f"layer {lay.digest} is not in the store",
                                               field="layer", fix="build the layer first")
                            if not manifest_file(tmp).exists():
                                write_manifest(tmp)
                            os.replace(tmp, final)
                            added.append(final)
                            added.append(manifest_file(final))
                            if meta_file(tmp).exists():        # EROFS metadata, packed
                                added.append(meta_file(final))
                                os.replace(meta_file(tmp), meta_file(final))
                            os.replace(manifest_file(tmp), manifest_file(final))
                        _fsync_dir(self.paths.store)
            except BaseException:
                for f in added:
                    f.unlink(missing_ok=True)
                raise
            if changed:
                log.info("registered image %s -> %s (%d layer(s))", name, image.digest,
                         len(image.layers))
                self.gc()                    # layers a replaced image no longer needs
            else:
                log.info("image %s already registered with digest %s", name, image.digest)
        if self.shared:
            self.shared.publish_image(image, pins)
        return image

    def _publish_source(self, digest: str, tmp: Path | None) -> Path:
        final = layer_file(self.paths, digest)
        if final.exists() or manifest_file(final).exists() or tmp is None:
            return final
        return tmp

    def publish(self, name: str) -> ImageInfo:
        """Publish image `name` (built on this node, e.g. before DSEC_LAYER_STORE was set) to the
        shared layer store; idempotent."""
        if self.shared is None:
            raise InvalidArgument("no shared layer store is configured", field="DSEC_LAYER_STORE",
                                  fix="set DSEC_LAYER_STORE=s3://BUCKET/PREFIX or file:///SHARED/PATH")
        image = self.get(name)
        pins = {}
        for lay in image.layers:
            final = layer_file(self.paths, lay.digest)
            if final.exists() and not manifest_file(final).exists():
                write_manifest(final)
            if not manifest_file(final).exists():
                raise NotFound(f"layer {lay.digest} of {name!r} has no file or manifest on this node",
                               field="layer", fix="rebuild the image on this node")
            pins[lay.digest] = self.shared.publish_layer(lay.digest, final)
        self.shared.publish_image(image, pins)
        return image

    def _fetch_shared(self, name: str) -> ImageInfo | None:
        """Look `name` up in the shared store; register it here (manifests checked and copied
        to the local store, bytes left in the shared store). None if the store lacks it."""
        assert self.shared is not None
        with self._fetch_lock:       # a burst of creations asks once, not once per sandbox
            known = self.registry.get_image(name)
            return known if known is not None else self._fetch_shared_locked(name)

    def _fetch_shared_locked(self, name: str) -> ImageInfo | None:
        assert self.shared is not None
        got = self.shared.fetch_record(name)
        if got is None:
            return None
        rec, layers, pins = got
        for lay in layers:
            final = layer_file(self.paths, lay.digest)
            if not manifest_file(final).exists():
                self.shared.fetch_manifest(lay.digest, pins[lay.digest])
        with self._store_lock:
            try:
                with self.registry.transaction() as db:
                    image, _ = self.registry.put_image(db, name, layers, replace=False,
                                                       kind=rec.get("kind", "image"), owner=rec.get("owner"))
            except Conflict:            # registered meanwhile (a build here, another fetch)
                return self.registry.get_image(name)
        log.info("fetched image %s (%s, %d layer(s)) from %s", name, image.digest[:19],
                 len(image.layers), self.shared.url)
        return image

    def _shared_source(self, digest: str) -> Path:
        """With a shared store: a layer this node has the file of (it built it, or pulled it)
        is mounted from that file; any other through the lazy view (or pulled whole)."""
        local = layer_file(self.paths, digest)
        if local.is_file():
            return local
        return self.lazy.source(digest) if self.lazy else self._local_layer(digest)

    def _local_layer(self, digest: str) -> Path:
        """The layer's file in the local store, pulled whole from the shared store if missing."""
        path = layer_file(self.paths, digest)
        if not path.is_file() and self.shared is not None:
            with FileLock(self.paths.store / f".pull-{digest[7:23]}.lock"):
                if not path.is_file():
                    self.shared.pull_layer(digest)
        return path

    # ---- lookup ----------------------------------------------------------------------

    def get(self, name_or_digest: str, field: str = "image") -> ImageInfo:
        info = None
        if isinstance(name_or_digest, str):
            if DIGEST_RE.match(name_or_digest):
                info = self.registry.get_image_by_digest(name_or_digest)
            else:
                info = self.registry.get_image(name_or_digest)
                if info is None and self.shared is not None and _NAME_OK.match(name_or_digest):
                    info = self._fetch_shared(name_or_digest)
        if info is None:
            what = {"image": "image", "name": "image or layer", "workspace": "workspace layer"
                    }.get(field, "toolkit layer")
            raise NotFound(f"no {what} {name_or_digest!r} on this node ({field})", field=field,
                           fix=self._not_found_fix())
        return info

    def _not_found_fix(self) -> str:
        names = self.registry.image_names(limit=6)
        have = (f"use one of: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}; or "
                if names else "no images are built yet; ")
        return (have + "build one, e.g. ensure_builtin(service, 'busybox') or "
                "'debian-python', or ImageService.build_from_tar(name, 'rootfs.tar.gz') / "
                "build_from_dir(name, path) / build_debootstrap(name, include=['python3'])")

    def list(self) -> list[ImageInfo]:
        return self.registry.list_images()

    def layer_path(self, digest: str) -> Path:
        path = layer_file(self.paths, check_digest(digest))
        if not path.is_file():
            raise NotFound(f"layer {digest} is not in the store", field="digest",
                           fix="use a digest listed in ImageService.get(name).layers")
        return path

    def layer_source(self, digest: str) -> Path:
        """The file a node reads a layer from (the lazy view of the store when one is set up,
        else the store's file): what VMs attach as a read-only disk."""
        path = self.mounts.source(digest) if self.mounts.source else self.layer_path(digest)
        if not path.is_file():
            raise NotFound(f"layer {digest} is not in the store ({path} is missing)", field="layer",
                           fix="rebuild the image that uses this layer")
        return path

    def mount_image(self, name_or_digest: str | ImageInfo) -> list[Path]:
        """Mount every layer of the image (once per node); returns the dirs, base first. Given
        the ImageInfo a create resolved, its layers are mounted even if the name was replaced
        meanwhile (they are held for REPLACED_GRACE_S), without looking the image up again."""
        info = name_or_digest if isinstance(name_or_digest, ImageInfo) else self.get(name_or_digest)
        out = []
        for lay in info.layers:
            try:
                out.append(self.mounts.ensure_mounted(lay.digest))
            except DsecError:
                # a layer read from the shared store: say so if that store is what failed
                if self.shared is not None and not layer_file(self.paths, lay.digest).exists():
                    self.shared.check_reachable()
                raise
        return out

    # ---- removal ---------------------------------------------------------------------

    def remove(self, name: str) -> list[str]:
        """Unregister `name`, then delete (after unmounting) every layer no image uses any
        more. Returns the deleted layer digests. Mounts are detached lazily: sandboxes still
        using a layer keep their view until they exit."""
        with self._store_lock:
            with self.registry.transaction() as db:
                if not self.registry.delete_image(db, name):
                    raise NotFound(f"no image {name!r} on this node", field="image",
                                   fix=self._not_found_fix())
            log.info("removed image %s", name)
            return self.gc()

    def gc(self) -> list[str]:
        """Delete layers referenced by no image, and layer files the registry does not know
        (left by a crash). Returns the digests deleted."""
        with self._store_lock:
            with self.registry.transaction() as db:
                self.registry.release_replaced(db, store.REPLACED_GRACE_S)
                dead = self.registry.unreferenced_layers(db)
                for d in dead:
                    self.registry.delete_layer(db, d)
            known = self.registry.layer_digests()
            for f in self.paths.store.iterdir():
                if _LAYER_FILE_RE.match(f.name):
                    d = "sha256:" + f.name[:64]
                    if d not in known and d not in dead:
                        log.warning("deleting unregistered layer file %s", f)
                        dead.append(d)
            for d in dead:
                self.mounts.unmount(d)
                layer_file(self.paths, d).unlink(missing_ok=True)
                manifest_file(layer_file(self.paths, d)).unlink(missing_ok=True)
                meta_file(layer_file(self.paths, d)).unlink(missing_ok=True)
                log.info("deleted layer %s", d)
            return dead

    def _sweep_stale_temps(self) -> None:
        cutoff = time.time() - STALE_TEMP_S
        try:
            for f in self.paths.store.glob(f"{TMP_PREFIX}*"):
                if f.stat().st_mtime < cutoff:
                    f.unlink(missing_ok=True)
            build = self.paths.home / "build"
            if build.is_dir():
                for d in build.iterdir():
                    if d.lstat().st_mtime < cutoff:
                        safe_rmtree(d)
        except OSError as e:
            log.warning("could not sweep stale temp files: %s", e)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
