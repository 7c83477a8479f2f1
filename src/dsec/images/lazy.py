"""On-demand layer loading: per-chunk digests recorded at build, and the node's lazy view.

The layer store (Paths.store) may be a shared filesystem. With DSEC_LAZY=1 a node does not
mount layer files from it directly: it runs one FUSE daemon (lazyfs.py under Debian's
python3 with python3-pyfuse3) mounted at <home>/lazy/mnt, which exposes every layer as
<hex>.erofs and fetches aligned chunks on first read into a bounded LRU cache on local disk
(<home>/lazy/cache, survives restarts), each chunk verified against the digest recorded at
build time (<hex>.chunks.json next to the layer). EROFS is then mounted file-backed from that
view. A failing or slow store turns into EIO for the reading process, never a hang.

A daemon that died leaves its mount listed but dead (every access: ENOTCONN, errno 107), and
the EROFS layer mounts on it with it. Before a create uses the view (ImageService.check_layer_view)
its daemon is checked; a dead one is replaced: the dead mount and the layer mounts on it are
detached (sandboxes already running from them keep failing reads of what they had not cached),
a new daemon is started and the layers are mounted from it again. If that fails, the create is
refused with 503 (Unavailable), never a client error.

With a shared layer store (DSEC_LAYER_STORE, shared.py) the view also reads layers built on
other nodes: their verified manifests are in the local store, their bytes are range-read
from the shared store, chunk by chunk, into the same bounded cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from dsec.config import Paths
from dsec.settings import ImageSettings
from dsec.types import InvalidArgument, Unavailable

from .erofsmeta import metadata_blocks
from .mounts import MNT_DETACH, mountinfo, sys_umount
from .store import FileLock, check_digest

log = logging.getLogger("dsec.images")

DEFAULT_CHUNK = 2 << 20
META_CHUNK = 256 << 10        # metadata pack segments: small, since a lookup touches few
META_GRANULE = 16 << 10       # metadata is packed in aligned pieces of this size
FS_TYPE = "fuse.dsec-lazy"
LAZYFS = Path(__file__).with_name("lazyfs.py")
SYSTEM_PYTHON = "/usr/bin/python3"


def manifest_file(layer: Path) -> Path:
    return layer.with_name(layer.name[:64] + ".chunks.json")


def meta_file(layer: Path) -> Path:
    """The layer's metadata pack: its EROFS metadata blocks, packed together (erofsmeta.py)."""
    return layer.with_name(layer.name[:64] + ".meta")


def _chunk_digests(path: Path, chunk: int) -> tuple[int, list[str]]:
    digests = []
    size = 0
    with open(path, "rb", buffering=0) as f:
        while data := f.read(chunk):
            digests.append(hashlib.sha256(data).hexdigest())
            size += len(data)
    return size, digests


def _runs(blocks: list[int]) -> list[list[int]]:
    """[1,2,3,7,8] -> [[1,3],[7,2]]: (first block, count) runs, to keep the manifest small."""
    out: list[list[int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return out


def _write_meta_pack(layer: Path) -> dict | None:
    """Pack the layer's EROFS metadata blocks into meta_file(layer); None if the image
    cannot be parsed (the view then fetches metadata with the data chunks, as before)."""
    try:
        bs, blocks = metadata_blocks(layer)
    except (ValueError, OSError) as e:
        log.warning("no metadata pack for %s: %s", layer.name, e)
        return None
    # the kernel reads the image's page cache in folios of several blocks (8 KiB seen on
    # 6.18), so a metadata read drags its neighbours along: pack whole aligned granules
    per = max(1, META_GRANULE // bs)
    nblocks = (os.stat(layer).st_size + bs - 1) // bs
    blocks = sorted({g + i for g in {b - b % per for b in blocks} for i in range(per)
                     if g + i < nblocks})
    out = meta_file(layer)
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    runs = _runs(blocks)
    with open(layer, "rb", buffering=0) as fi, open(tmp, "wb") as fo:
        for first, count in runs:
            fo.write(os.pread(fi.fileno(), count * bs, first * bs))
    size, digests = _chunk_digests(tmp, META_CHUNK)
    os.replace(tmp, out)
    return {"blksz": bs, "runs": runs, "size": size, "chunk": META_CHUNK, "sha256": digests}


def write_manifest(layer: Path, chunk: int = DEFAULT_CHUNK, *, meta: bool = True) -> Path:
    """Record the sha256 of every aligned `chunk`-byte piece of a layer file (atomically),
    and (meta=True) write its metadata pack with per-segment digests."""
    if chunk < 4096 or chunk & (chunk - 1) or chunk > 64 << 20:
        raise InvalidArgument(f"bad chunk size {chunk}", field="chunk",
                              fix="a power of two between 4 KiB and 64 MiB, e.g. 2 MiB")
    size, digests = _chunk_digests(layer, chunk)
    man: dict = {"size": size, "chunk": chunk, "sha256": digests}
    if meta and (m := _write_meta_pack(layer)) is not None:
        man["meta"] = m
    else:
        meta_file(layer).unlink(missing_ok=True)
    out = manifest_file(layer)
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    tmp.write_text(json.dumps(man))
    os.replace(tmp, out)
    return out


class LazyView:
    """The node's one lazy FUSE view of the layer store (started on first use, idempotent
    across threads and processes)."""

    def __init__(self, paths: Paths, *, store: Path | None = None, chunk: int = DEFAULT_CHUNK,
                 cache_bytes: int | None = None, latency_ms: float | None = None,
                 timeout_s: float | None = None, root: Path | None = None,
                 bandwidth_mbps: float | None = None, prefetch: bool | None = None,
                 meta: bool = True, remote: str | None = None, settings: ImageSettings | None = None):
        s = settings or ImageSettings()     # what the arguments left out (DSEC_LAZY_*)
        self.paths = paths
        self.store = Path(store or paths.store)
        self.root = Path(root or paths.home / "lazy")
        self.mnt = self.root / "mnt"
        self.cache = self.root / "cache"
        self.chunk = chunk
        self.cache_bytes = cache_bytes if cache_bytes is not None else s.lazy_cache_bytes
        self.latency_ms = latency_ms if latency_ms is not None else s.lazy_latency_ms
        self.timeout_s = timeout_s if timeout_s is not None else s.lazy_timeout_s
        # injected store bandwidth (MB/s, 0 = unlimited) for benchmarks; prefetch = bulk
        # fetch of a layer's recorded access profile when the layer is first opened
        self.bandwidth_mbps = bandwidth_mbps if bandwidth_mbps is not None else s.lazy_bandwidth_mbps
        self.prefetch = prefetch if prefetch is not None else s.lazy_prefetch
        self.trace = s.lazyfs_trace
        self.meta = meta
        # the shared layer store to range-read layers this node has no file of
        self.remote = remote if remote is not None else (s.layer_store or None)
        self._lock = FileLock(self.root / ".lock")

    def is_mounted(self) -> bool:
        mp = os.path.realpath(self.mnt)
        return any(m.mountpoint == mp and m.fstype == FS_TYPE for m in mountinfo())

    def alive(self) -> bool:
        """The view answers: its daemon runs and its mount is not a dead FUSE connection."""
        try:
            pid = int((self.root / "pid").read_text())
        except (OSError, ValueError):
            return False
        if not _cmdline_has(pid, str(LAZYFS)):     # gone (a zombie's cmdline is empty)
            return False
        try:
            os.stat(self.mnt)
        except OSError:                             # ENOTCONN: the connection is dead
            return False
        return True

    def ensure_alive(self) -> bool:
        """Restart a view whose daemon died (a view not started yet is left to its first
        use). True if it was restarted; Unavailable if it could not be."""
        if not self.is_mounted() or self.alive():
            return False
        self.start()
        return True

    def start(self) -> None:
        if self.is_mounted() and self.alive():
            self._check_remote()
            return
        with self._lock:
            if self.is_mounted():
                if self.alive():
                    self._check_remote()
                    return
                self._clear_dead()
            if not os.path.exists(SYSTEM_PYTHON) or subprocess.run(
                    [SYSTEM_PYTHON, "-c", "import pyfuse3, trio"], capture_output=True).returncode:
                raise Unavailable("the lazy layer view needs Debian's python3-pyfuse3",
                                  fix="apt-get install -y python3-pyfuse3 fuse3, or unset DSEC_LAZY")
            if self.remote and self.remote.startswith("s3:") and subprocess.run(
                    [SYSTEM_PYTHON, "-c", "import botocore"], capture_output=True).returncode:
                raise Unavailable(f"the lazy layer view reads {self.remote} with botocore, which "
                                  f"{SYSTEM_PYTHON} lacks", field=None,
                                  fix="apt-get install -y python3-botocore")
            self.mnt.mkdir(parents=True, exist_ok=True)
            self.cache.mkdir(parents=True, exist_ok=True)
            try:                      # a daemon that died leaves "transport endpoint not connected"
                sys_umount(str(self.mnt), MNT_DETACH)
            except OSError:
                pass
            try:
                proc = self._spawn()
            except OSError as e:   # the node's own fault (its disk, its python3): never the caller's
                raise Unavailable(f"the lazy layer view at {self.mnt} could not be started: {e}",
                                  fix=f"check {self.root} (free space, permissions) and {SYSTEM_PYTHON}; "
                                      "the next create tries again") from e
            (self.root / "pid").write_text(str(proc.pid))
            (self.root / "remote").write_text(self.remote or "")
            deadline = time.monotonic() + 20
            while not self.is_mounted():
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    tail = (self.root / "lazyfs.log").read_bytes()[-1500:].decode(errors="replace")
                    raise Unavailable(f"the lazy layer view did not start: {tail}",
                                      fix=f"see {self.root / 'lazyfs.log'}")
                time.sleep(0.02)
            _no_readahead(self.mnt)
            log.info("lazy layer view of %s at %s (pid %d)", self.store, self.mnt, proc.pid)

    def _spawn(self) -> subprocess.Popen[bytes]:
        """The FUSE daemon, its output appended to lazyfs.log."""
        with open(self.root / "lazyfs.log", "ab") as logf:
            proc = subprocess.Popen(
                [SYSTEM_PYTHON, str(LAZYFS), "--store", str(self.store), "--cache", str(self.cache),
                 "--mount", str(self.mnt), "--cache-bytes", str(self.cache_bytes),
                 "--latency-ms", str(self.latency_ms), "--timeout-s", str(self.timeout_s),
                 "--bandwidth-mbps", str(self.bandwidth_mbps),
                 *([] if self.prefetch else ["--no-prefetch"]),
                 *([] if self.meta else ["--no-meta"]),
                 *(["--trace"] if self.trace else []),
                 *(["--remote", self.remote] if self.remote else [])],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                close_fds=True)
        return proc

    def _clear_dead(self) -> None:
        """Detach a dead view and the layer mounts made from it, so that new ones are made
        from the daemon started next (under self._lock)."""
        mnt = os.path.realpath(self.mnt) + "/"
        stale = [m.mountpoint for m in mountinfo() if m.fstype == "erofs" and m.source.startswith(mnt)]
        log.error("the lazy layer view's daemon died: restarting it", extra={"mount": str(self.mnt),
                                                                              "layer_mounts": len(stale)})
        for mp in stale:
            try:
                sys_umount(mp, MNT_DETACH)
            except OSError as e:
                log.warning("could not detach layer mount %s of the dead view: %s", mp, e)
        try:
            pid = int((self.root / "pid").read_text())
            os.waitpid(pid, os.WNOHANG)             # our child: reap it
        except (OSError, ValueError, ChildProcessError):
            pass

    def _check_remote(self) -> None:
        """A view started with another shared store (or none) keeps serving until it is
        restarted, which needs every layer mount on it gone: say so once."""
        try:
            running = (self.root / "remote").read_text()
        except OSError:
            running = ""
        if running != (self.remote or "") and not getattr(self, "_warned", False):
            self._warned = True
            log.warning("the lazy view at %s reads shared store %r, not %r: stop dsec, then "
                        "fusermount3 -u -z the view (layer mounts on it first) to switch", self.mnt, running or None, self.remote)

    def stop(self) -> None:
        """Unmount the view (the daemon exits). EROFS mounts still using it keep a reference
        until they are unmounted; unmount those first."""
        with self._lock:
            pid = None
            try:
                pid = int((self.root / "pid").read_text())
            except (OSError, ValueError):
                pass
            for _ in range(4):
                if not self.is_mounted():
                    break
                r = subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True) \
                    if shutil.which("fusermount3") else None
                if r is None or r.returncode:
                    try:
                        sys_umount(str(self.mnt), MNT_DETACH)
                    except OSError:
                        pass
            # the daemon sees the unmount only once the last user of the (lazily
            # detached) connection is gone; it holds no state worth a graceful exit
            if pid and _cmdline_has(pid, str(LAZYFS)):
                for sig, wait_s in ((0, 1.0), (15, 5.0), (9, 5.0)):
                    try:
                        if sig:
                            os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                    if _wait_gone(pid, wait_s):
                        break

    def source(self, digest: str) -> Path:
        """The path to mount layer `digest` from: its file in the lazy view."""
        hexd = check_digest(digest).split(":", 1)[1]
        store_file = self.store / f"{hexd}.erofs"
        if not manifest_file(store_file).exists() and store_file.exists():
            write_manifest(store_file, self.chunk)        # a layer built before lazy loading
        self.start()
        return self.mnt / f"{hexd}.erofs"

    def profile(self, digest: str) -> dict | None:
        """The layer's recorded access profile ({"data": [chunk idx], "meta": [segment idx]},
        first-touch order), kept next to the chunk cache; None before any read."""
        hexd = check_digest(digest).split(":", 1)[1]
        try:
            return json.loads((self.cache / f"{hexd}.profile.json").read_text())
        except (OSError, ValueError):
            return None

    def stats(self) -> dict:
        try:
            return json.loads((self.cache / "stats.json").read_text())
        except (OSError, ValueError):
            return {"fetched_bytes": 0, "fetched_chunks": 0, "cache_hits": 0, "errors": 0}


def _no_readahead(mnt: Path) -> None:
    """Turn off kernel readahead on the view's FUSE connection. EROFS reads its metadata
    through the page cache of the image file; readahead there would widen a 4 KiB
    metadata read into 128 KiB that spills into data chunks. EROFS does its own readahead
    for file data, so nothing is lost."""
    dev = os.stat(mnt).st_dev
    ra = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        ra.write_text("0")
    except OSError as e:
        log.warning("could not turn off readahead on %s (%s): %s", mnt, ra, e)


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait_gone(pid: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)       # reap it if it is our child
        except ChildProcessError:
            pass
        try:
            if b"State:\tZ" in Path(f"/proc/{pid}/status").read_bytes():
                return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def lazy_enabled(s: ImageSettings) -> bool:
    """DSEC_LAZY=1; or unset with a shared layer store (DSEC_LAYER_STORE): a node then pulls
    only the chunks its sandboxes read. DSEC_LAZY=0 there pulls whole layers instead."""
    return s.lazy if s.lazy is not None else bool(s.layer_store)


__all__ = ["LazyView", "write_manifest", "manifest_file", "meta_file", "lazy_enabled"]
