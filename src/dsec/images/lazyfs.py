"""dsec-lazyfs: a read-only FUSE view of a layer store that fetches on demand.

Run with Debian's python3 (python3-pyfuse3; stdlib + pyfuse3 + trio only, no dsec imports):

    /usr/bin/python3 lazyfs.py --store DIR --cache DIR --mount DIR [--cache-bytes N]
                               [--latency-ms L] [--timeout-s T]

The root lists `<hex>.erofs` for every layer of the store that has a chunk manifest
`<hex>.chunks.json` ({"size", "chunk", "sha256": [per-chunk hex digests]}, written at build).
A read fetches the aligned chunks it touches (1-4 MiB) from the store on first use, checks
each against its digest, and keeps it in a bounded LRU chunk cache on local disk
(`<cache>/<hex>/<idx>`, survives restarts; mtime = last use). A store that fails, returns
bad bytes, or does not answer within --timeout-s makes the read fail with EIO: it never hangs
and never returns unverified data. Counters go to `<cache>/stats.json` after every fetch.
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
import time
from collections import OrderedDict

import pyfuse3
import trio

log = logging.getLogger("dsec.lazyfs")
STATS_INODE_NAME = "stats.json"


class LazyFS(pyfuse3.Operations):
    def __init__(self, store: str, cache: str, cache_bytes: int, latency_s: float, timeout_s: float):
        super().__init__()
        self.store, self.cache = store, cache
        self.cache_bytes, self.latency_s, self.timeout_s = cache_bytes, latency_s, timeout_s
        self.names: dict[str, int] = {}          # "<hex>.erofs" -> inode
        self.files: dict[int, dict] = {}         # inode -> {"hex", "size", "chunk", "sha256"}
        self.lru: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.used = 0
        self.inflight: dict[tuple[str, int], trio.Event] = {}
        self.stats = {"fetched_bytes": 0, "fetched_chunks": 0, "cache_hits": 0, "errors": 0,
                      "evicted_chunks": 0, "fetch_s": 0.0}
        self.mtime_ns = time.time_ns()
        os.makedirs(cache, exist_ok=True)
        self._load_cache()

    # -- cache -----------------------------------------------------------------------
    def _load_cache(self) -> None:
        found = []
        for hexd in os.listdir(self.cache):
            d = os.path.join(self.cache, hexd)
            if len(hexd) != 64 or not os.path.isdir(d):
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
                info = {"hex": n[:64], "size": int(man["size"]), "chunk": int(man["chunk"]),
                        "sha256": list(man["sha256"])}
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("bad chunk manifest %s: %s", n, e)
                continue
            ino = pyfuse3.ROOT_INODE + 1 + len(self.names)
            self.names[name] = ino
            self.files[ino] = info

    def _fetch_sync(self, info: dict, idx: int) -> bytes:
        if self.latency_s:
            time.sleep(self.latency_s)
        off = idx * info["chunk"]
        want = min(info["chunk"], info["size"] - off)
        with open(os.path.join(self.store, info["hex"] + ".erofs"), "rb", buffering=0) as f:
            data = os.pread(f.fileno(), want, off)
        if len(data) != want or hashlib.sha256(data).hexdigest() != info["sha256"][idx]:
            raise OSError(errno.EIO, f"chunk {idx} of {info['hex'][:12]} failed verification")
        return data

    async def _chunk(self, info: dict, idx: int) -> bytes:
        key = (info["hex"], idx)
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
            ev = self.inflight.get(key)
            if ev is None:
                break
            await ev.wait()                          # someone else is fetching it
            if key not in self.lru:
                raise pyfuse3.FUSEError(errno.EIO)
        ev = self.inflight[key] = trio.Event()
        t0 = time.monotonic()
        try:
            data = None
            with trio.move_on_after(self.timeout_s):
                data = await trio.to_thread.run_sync(self._fetch_sync, info, idx,
                                                     cancellable=True)
            if data is None:
                raise OSError(errno.ETIMEDOUT, f"store did not answer in {self.timeout_s}s")
            os.makedirs(os.path.join(self.cache, key[0]), exist_ok=True)
            tmp = self._chunk_path(*key) + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._chunk_path(*key))
            self.lru[key] = len(data)
            self.used += len(data)
            self.stats["fetched_bytes"] += len(data)
            self.stats["fetched_chunks"] += 1
            self.stats["fetch_s"] += time.monotonic() - t0
            self._evict()
            return data
        except OSError as e:
            self.stats["errors"] += 1
            log.error("fetch of chunk %d of %s failed: %s", idx, key[0][:12], e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            del self.inflight[key]
            ev.set()
            self._write_stats()

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
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        info = self.files[fh]
        end = min(off + size, info["size"])
        if off >= end:
            return b""
        c = info["chunk"]
        out = bytearray()
        for idx in range(off // c, (end - 1) // c + 1):
            data = await self._chunk(info, idx)
            lo = max(off, idx * c) - idx * c
            hi = min(end, (idx + 1) * c) - idx * c
            out += data[lo:hi]
        return bytes(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--mount", required=True)
    ap.add_argument("--cache-bytes", type=int, default=8 << 30)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    fs = LazyFS(a.store, a.cache, a.cache_bytes, a.latency_ms / 1000, a.timeout_s)
    fs._refresh()
    opts = set(pyfuse3.default_options) | {"fsname=dsec-lazy", "subtype=dsec-lazy", "ro"}
    opts.discard("default_permissions")
    pyfuse3.init(fs, a.mount, opts)
    log.info("serving %s at %s (cache %s, %d bytes)", a.store, a.mount, a.cache, a.cache_bytes)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
