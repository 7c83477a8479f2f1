"""dsec-lazyfs: a read-only FUSE view of a layer store that fetches on demand.

Run with Debian's python3 (python3-pyfuse3; stdlib + pyfuse3 + trio only, no dsec imports;
--remote s3:// adds python3-botocore, through the sibling layerstore.py):

    /usr/bin/python3 lazyfs.py --store DIR --cache DIR --mount DIR [--cache-bytes N]
                               [--latency-ms L] [--timeout-s T] [--bandwidth-mbps B]
                               [--no-prefetch] [--no-meta] [--remote URL]

The root lists `<hex>.erofs` for every layer of the store that has a chunk manifest
`<hex>.chunks.json` ({"size", "chunk", "sha256": [per-chunk hex digests]}, written at build).
A read fetches the aligned chunks it touches (1-4 MiB) from the store on first use, checks
each against its digest, and keeps it in a bounded LRU chunk cache on local disk
(`<cache>/<hex>/<idx>`, survives restarts; mtime = last use). A store that fails, returns
bad bytes, or does not answer within --timeout-s makes the read fail with EIO: it never hangs
and never returns unverified data. Counters go to `<cache>/stats.json` after every fetch.

Shared store: with --remote (s3://BUCKET/PREFIX or file:///PATH, layerstore.py beside this
file), a layer whose manifest is in --store but whose file is not (a layer built on another
node) is read from the remote store by range: only the chunks a reader touches travel, each
verified like a local one (the manifest itself was checked against the image record before
it was written to --store).

Metadata kept local: when the manifest has a "meta" section, the layer's EROFS metadata
blocks are also in the store packed together (`<hex>.meta`, 256 KiB verified segments), and
reads of those blocks are served from the pack, so path lookups do not pull 2 MiB data
chunks. Access profiles: every chunk/segment a reader touches is recorded, in first-touch
order, in `<cache>/<hex>.profile.json` (survives restarts); when a layer is first opened
and a profile exists, its chunks are fetched in bulk (coalesced large requests, several in
parallel) before the sandbox asks for them. --latency-ms/--bandwidth-mbps inject a slow
store (per request latency; one shared bandwidth) for benchmarks.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import stat
import sys
import threading
import time
from collections import OrderedDict

import pyfuse3
import trio

log = logging.getLogger("dsec.lazyfs")
STATS_INODE_NAME = "stats.json"
PREFETCH_RUN = 16 << 20          # largest single prefetch request
PREFETCH_PARALLEL = 4
TRACE = False                    # --trace (DSEC_LAZYFS_TRACE): log every read


class LazyFS(pyfuse3.Operations):
    def __init__(self, store: str, cache: str, cache_bytes: int, latency_s: float, timeout_s: float,
                 bandwidth_bps: float = 0.0, prefetch: bool = True, meta: bool = True,
                 remote: str | None = None):
        super().__init__()
        self.remote = None
        if remote:
            from layerstore import open_store          # the sibling file (stdlib + botocore)
            self.remote = open_store(remote, timeout_s=max(1.0, min(timeout_s, 10.0)))
        self.store, self.cache = store, cache
        self.cache_bytes, self.latency_s, self.timeout_s = cache_bytes, latency_s, timeout_s
        self.bandwidth_bps, self.prefetch, self.use_meta = bandwidth_bps, prefetch, meta
        self._bw_lock = threading.Lock()
        self._bw_next = 0.0
        self.names: dict[str, int] = {}          # "<hex>.erofs" -> inode
        self.files: dict[int, dict] = {}         # inode -> {"hex", "key", "file", "size", ...}
        self.lru: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.used = 0
        self.inflight: dict[tuple[str, int], tuple[trio.Event, bool]] = {}
        self.profiles: dict[str, dict] = {}      # hex -> {"data": [...], "meta": [...]}
        self.dirty_profiles: set[str] = set()
        self.opened: set[int] = set()
        self.nursery: trio.Nursery | None = None
        self.stats = {"fetched_bytes": 0, "fetched_chunks": 0, "cache_hits": 0, "errors": 0,
                      "evicted_chunks": 0, "fetch_s": 0.0, "meta_bytes": 0,
                      "prefetched_bytes": 0, "requests": 0, "remote_bytes": 0,
                      "remote_requests": 0}
        self.mtime_ns = time.time_ns()
        os.makedirs(cache, exist_ok=True)
        self._load_cache()

    # -- cache -----------------------------------------------------------------------
    def _load_cache(self) -> None:
        found = []
        for hexd in os.listdir(self.cache):
            d = os.path.join(self.cache, hexd)
            if not (len(hexd) == 64 or (len(hexd) == 65 and hexd[-1] == "m")) or \
                    not os.path.isdir(d):
                continue
            for n in os.listdir(d):
                if n.isdigit():
                    st = os.stat(os.path.join(d, n))
                    found.append((st.st_mtime_ns, hexd, int(n), st.st_size))
                else:
                    os.unlink(os.path.join(d, n))           # a partial write from a crash
        for _, hexd, idx, size in sorted(found):
            self.lru[(hexd, idx)] = size
            self.used += size
        self._evict()

    def _chunk_path(self, hexd: str, idx: int) -> str:
        return os.path.join(self.cache, hexd, str(idx))

    def _evict(self) -> None:
        while self.used > self.cache_bytes and self.lru:
            (hexd, idx), size = self.lru.popitem(last=False)
            try:
                os.unlink(self._chunk_path(hexd, idx))
            except FileNotFoundError:
                pass
            self.used -= size
            self.stats["evicted_chunks"] += 1

    def _write_stats(self) -> None:
        tmp = os.path.join(self.cache, f".{STATS_INODE_NAME}.tmp")
        with open(tmp, "w") as f:
            json.dump({**self.stats, "cache_used_bytes": self.used}, f)
        os.replace(tmp, os.path.join(self.cache, STATS_INODE_NAME))

    # -- store -----------------------------------------------------------------------
    def _refresh(self) -> None:
        try:
            names = os.listdir(self.store)
        except OSError as e:
            log.error("cannot list store %s: %s", self.store, e)
            return
        for n in names:
            if not n.endswith(".chunks.json") or len(n) != 64 + 12:
                continue
            name = n[:64] + ".erofs"
            if name in self.names:
                continue
            try:
                with open(os.path.join(self.store, n)) as f:
                    man = json.load(f)
                info = {"hex": n[:64], "key": n[:64], "file": n[:64] + ".erofs",
                        "size": int(man["size"]), "chunk": int(man["chunk"]),
                        "sha256": list(man["sha256"]), "meta": _meta_info(n[:64], man.get("meta"))}
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("bad chunk manifest %s: %s", n, e)
                continue
            ino = pyfuse3.ROOT_INODE + 1 + len(self.names)
            self.names[name] = ino
            self.files[ino] = info

    def _transfer_delay(self, nbytes: int) -> None:
        """Injected store cost of one request: latency, then nbytes over one shared link."""
        if self.latency_s:
            time.sleep(self.latency_s)
        if self.bandwidth_bps:
            with self._bw_lock:
                start = max(time.monotonic(), self._bw_next)
                self._bw_next = done = start + nbytes / self.bandwidth_bps
            time.sleep(max(0.0, done - time.monotonic()))

    def _fetch_sync(self, info: dict, idx: int, count: int = 1) -> tuple[list[bytes], bool]:
        """Chunks idx..idx+count-1 of `info` in one request, each verified; and whether they
        came from the remote store."""
        off = idx * info["chunk"]
        want = min(count * info["chunk"], info["size"] - off)
        self._transfer_delay(want)
        local = os.path.join(self.store, info["file"])
        remote = self.remote is not None and not os.path.exists(local)
        if remote:
            data = self.remote.get_range("layers/" + info["file"], off, want)
        else:
            with open(local, "rb", buffering=0) as f:
                data = os.pread(f.fileno(), want, off)
        out = []
        for i in range(count):
            piece = data[i * info["chunk"]:(i + 1) * info["chunk"]]
            exp = min(info["chunk"], info["size"] - (idx + i) * info["chunk"])
            if len(piece) != exp or hashlib.sha256(piece).hexdigest() != info["sha256"][idx + i]:
                raise OSError(errno.EIO, f"chunk {idx + i} of {info['file'][:12]} failed "
                                         "verification")
            out.append(piece)
        return out, remote

    def _store_chunk(self, key: tuple[str, int], data: bytes) -> None:
        os.makedirs(os.path.join(self.cache, key[0]), exist_ok=True)
        tmp = self._chunk_path(*key) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._chunk_path(*key))
        self.lru[key] = len(data)
        self.used += len(data)

    # -- access profiles -----------------------------------------------------------------
    def _profile(self, hexd: str) -> dict:
        p = self.profiles.get(hexd)
        if p is None:
            try:
                with open(os.path.join(self.cache, f"{hexd}.profile.json")) as f:
                    raw = json.load(f)
                p = {"data": [int(i) for i in raw.get("data", [])],
                     "meta": [int(i) for i in raw.get("meta", [])]}
            except (OSError, ValueError, TypeError, AttributeError):
                p = {"data": [], "meta": []}
            p["_seen"] = {("data", i) for i in p["data"]} | {("meta", i) for i in p["meta"]}
            self.profiles[hexd] = p
        return p

    def _record(self, info: dict, idx: int) -> None:
        kind = "meta" if info["key"].endswith("m") else "data"
        p = self._profile(info["hex"])
        if (kind, idx) not in p["_seen"]:
            p["_seen"].add((kind, idx))
            p[kind].append(idx)
            self.dirty_profiles.add(info["hex"])

    def _save_profiles(self) -> None:
        for hexd in list(self.dirty_profiles):
            p = self.profiles[hexd]
            path = os.path.join(self.cache, f"{hexd}.profile.json")
            try:
                with open(path + ".tmp", "w") as f:
                    json.dump({"data": p["data"], "meta": p["meta"]}, f)
                os.replace(path + ".tmp", path)
            except OSError as e:
                log.warning("cannot save access profile of %s: %s", hexd[:12], e)
        self.dirty_profiles.clear()

    async def _prefetch(self, info: dict) -> None:
        """Fetch the chunks of the layer's recorded profile, in large coalesced requests,
        several at a time (meta segments first, then data in first-touch order)."""
        p = self._profile(info["hex"])
        jobs: list[tuple[int, dict, int, int]] = []
        for target, kind in ((info.get("meta"), "meta"), (info, "data")):
            if target is None or not p[kind]:
                continue
            rank = {i: r for r, i in enumerate(p[kind])}
            n = len(target["sha256"])
            todo = sorted(i for i in rank if 0 <= i < n and (target["key"], i) not in self.lru)
            per = max(1, PREFETCH_RUN // target["chunk"])
            run: list[int] = []
            for i in todo + [-2]:
                if run and (i != run[-1] + 1 or len(run) >= per):
                    first = min(rank[j] for j in run)
                    jobs.append((first if kind == "data" else -1, target, run[0], len(run)))
                    run = []
                if i >= 0:
                    run.append(i)
        jobs.sort(key=lambda j: j[0])
        if not jobs:
            return
        t0 = time.monotonic()
        limiter = trio.CapacityLimiter(PREFETCH_PARALLEL)

        async def one(target: dict, first: int, count: int) -> None:
            async with limiter:
                await self._fetch_run(target, first, count, prefetch=True)

        async with trio.open_nursery() as n:
            for _, target, first, count in jobs:
                n.start_soon(one, target, first, count)
        log.info("prefetched %s: %d request(s) in %.2fs", info["hex"][:12], len(jobs),
                 time.monotonic() - t0)

    async def _chunk(self, info: dict, idx: int) -> bytes:
        key = (info["key"], idx)
        self._record(info, idx)
        while True:
            if key in self.lru:
                try:
                    with open(self._chunk_path(*key), "rb") as f:
                        data = f.read()
                    self.lru.move_to_end(key)
                    os.utime(self._chunk_path(*key))
                    self.stats["cache_hits"] += 1
                    return data
                except FileNotFoundError:
                    self.used -= self.lru.pop(key, 0)
            pending = self.inflight.get(key)
            if pending is None:
                break
            ev, by_prefetch = pending
            await ev.wait()                          # someone else is fetching it
            if key not in self.lru and not by_prefetch:
                raise pyfuse3.FUSEError(errno.EIO)   # a failed prefetch: fetch it ourselves
        await self._fetch_run(info, idx, 1, prefetch=False)
        data = None
        if key in self.lru:
            with open(self._chunk_path(*key), "rb") as f:
                data = f.read()
        if data is None:
            raise pyfuse3.FUSEError(errno.EIO)
        return data

    async def _fetch_run(self, info: dict, first: int, count: int, *, prefetch: bool) -> None:
        """Fetch chunks first..first+count-1 in one store request into the cache. Chunks
        already cached or in flight are skipped (the run is trimmed to the missing span)."""
        keys = [(info["key"], i) for i in range(first, first + count)]
        while keys and (keys[0] in self.lru or keys[0] in self.inflight):
            keys.pop(0)
        while keys and (keys[-1] in self.lru or keys[-1] in self.inflight):
            keys.pop()
        if any(k in self.inflight for k in keys):
            keys = keys[:next(i for i, k in enumerate(keys) if k in self.inflight)]
        if not keys:
            return
        ev = trio.Event()
        for k in keys:
            self.inflight[k] = (ev, prefetch)
        t0 = time.monotonic()
        try:
            got = None
            with trio.move_on_after(self.timeout_s):
                got = await trio.to_thread.run_sync(self._fetch_sync, info, keys[0][1], len(keys),
                                                    cancellable=True)
            if got is None:
                raise OSError(errno.ETIMEDOUT, f"store did not answer in {self.timeout_s}s")
            data, remote = got
            if remote:
                self.stats["remote_bytes"] += sum(len(p) for p in data)
                self.stats["remote_requests"] += 1
            for k, piece in zip(keys, data):
                self._store_chunk(k, piece)
                self.stats["fetched_bytes"] += len(piece)
                self.stats["fetched_chunks"] += 1
                if info["key"].endswith("m"):
                    self.stats["meta_bytes"] += len(piece)
                if prefetch:
                    self.stats["prefetched_bytes"] += len(piece)
            self.stats["requests"] += 1
            self.stats["fetch_s"] += time.monotonic() - t0
            self._evict()
        except OSError as e:
            self.stats["errors"] += 1
            log.error("fetch of chunks %d+%d of %s failed: %s", keys[0][1], len(keys),
                      info["file"][:12], e)
            if not prefetch:
                raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            for k in keys:
                self.inflight.pop(k, None)
            ev.set()
            self._write_stats()

    async def _read_span(self, info: dict, off: int, end: int) -> bytes:
        c = info["chunk"]
        out = bytearray()
        for idx in range(off // c, (end - 1) // c + 1):
            data = await self._chunk(info, idx)
            lo = max(off, idx * c) - idx * c
            hi = min(end, (idx + 1) * c) - idx * c
            out += data[lo:hi]
        return bytes(out)

    # -- FUSE ------------------------------------------------------------------------
    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_uid = a.st_gid = 0
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.mtime_ns
        a.entry_timeout = a.attr_timeout = 3600
        a.st_blksize = 4096
        if ino == pyfuse3.ROOT_INODE:
            a.st_mode, a.st_nlink, a.st_size = stat.S_IFDIR | 0o555, 2, 0
        else:
            a.st_mode, a.st_nlink = stat.S_IFREG | 0o444, 1
            a.st_size = self.files[ino]["size"]
        a.st_blocks = (a.st_size + 511) // 512
        return a

    async def getattr(self, inode, ctx=None):
        if inode != pyfuse3.ROOT_INODE and inode not in self.files:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        n = name.decode(errors="replace")
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if n not in self.names:
            self._refresh()                  # a layer built after we started
        if n not in self.names:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self.names[n])

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        self._refresh()
        return inode

    async def readdir(self, fh, start_id, token):
        items = sorted(self.names.items())
        for i, (name, ino) in enumerate(items[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, name.encode(), self._attr(ino), i + 1):
                break

    async def open(self, inode, flags, ctx):
        if inode not in self.files:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode not in self.opened:
            self.opened.add(inode)
            if self.prefetch and self.nursery is not None:
                self.nursery.start_soon(self._prefetch, self.files[inode])
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        info = self.files[fh]
        if TRACE:
            log.info("read %s off=%d size=%d", info["hex"][:12], off, size)
        end = min(off + size, info["size"])
        if off >= end:
            return b""
        meta = info["meta"] if self.use_meta else None
        if meta is None:
            data = await self._read_span(info, off, end)
        else:
            # split into runs served from the metadata pack and runs from the data chunks
            bs, where = meta["blksz"], meta["map"]
            out = bytearray()
            pos = off
            while pos < end:
                b = pos // bs
                po = where.get(b)
                stop = min(end, (b + 1) * bs)
                if po is not None:
                    while stop < end and where.get(stop // bs) == po + stop - pos + (pos - b * bs):
                        stop = min(end, stop + bs)
                    start = po + pos - b * bs
                    out += await self._read_span(meta, start, start + stop - pos)
                else:
                    while stop < end and (stop // bs) not in where:
                        stop = min(end, stop + bs)
                    out += await self._read_span(info, pos, stop)
                pos = stop
            data = bytes(out)
        if self.dirty_profiles:
            self._save_profiles()
        return data


def _meta_info(hexd: str, m: dict | None) -> dict | None:
    """The metadata pack of a layer as a chunked file, plus block -> offset-in-pack."""
    if not m:
        return None
    bs = int(m["blksz"])
    where: dict[int, int] = {}
    pos = 0
    for first, count in m["runs"]:
        for b in range(int(first), int(first) + int(count)):
            where[b] = pos
            pos += bs
    return {"hex": hexd, "key": hexd + "m", "file": hexd + ".meta", "size": int(m["size"]),
            "chunk": int(m["chunk"]), "sha256": list(m["sha256"]), "blksz": bs, "map": where}


async def _serve(fs: LazyFS) -> None:
    async with trio.open_nursery() as n:
        fs.nursery = n
        await pyfuse3.main()
        n.cancel_scope.cancel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--mount", required=True)
    ap.add_argument("--cache-bytes", type=int, default=8 << 30)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--bandwidth-mbps", type=float, default=0.0)
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--no-meta", action="store_true")
    ap.add_argument("--remote", default=None)
    ap.add_argument("--trace", action="store_true")
    a = ap.parse_args()
    global TRACE
    TRACE = a.trace
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    fs = LazyFS(a.store, a.cache, a.cache_bytes, a.latency_ms / 1000, a.timeout_s,
                bandwidth_bps=a.bandwidth_mbps * 1e6, prefetch=not a.no_prefetch,
                meta=not a.no_meta, remote=a.remote)
    fs._refresh()
    opts = set(pyfuse3.default_options) | {"fsname=dsec-lazy", "subtype=dsec-lazy", "ro"}
    opts.discard("default_permissions")
    pyfuse3.init(fs, a.mount, opts)
    log.info("serving %s%s at %s (cache %s, %d bytes)", a.store,
             f" + remote {a.remote}" if a.remote else "", a.mount, a.cache, a.cache_bytes)
    try:
        trio.run(_serve, fs)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
