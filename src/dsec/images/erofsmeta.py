"""Find the metadata blocks of an EROFS image: what a tree walk (stat, readdir, readlink,
getxattr) reads, as opposed to file contents.

Why: mkfs.erofs 1.5 interleaves inodes, directories and file data, so a lazy view that
fetches 2 MiB chunks pulls most of a small image just to resolve paths. Recording these
blocks at build time lets the node fetch them once, packed together in one request (the
`<hex>.meta` sidecar, see lazy.py), and keep them local (the reference system's
data/metadata split).

Parses the on-disk format (linux/fs/erofs/erofs_fs.h): superblock at 1024, inodes at
meta_blkaddr * blksz + nid * 32 (compact 32 B or extended 64 B), inline xattr body, then
the inline tail of FLAT_INLINE files; directory blocks hold 12-byte dirents followed by
their names. Unknown or damaged structures raise ValueError (callers fall back to no pack).
"""

from __future__ import annotations

import struct
from pathlib import Path

SUPER_OFFSET = 1024
MAGIC = 0xE0F5E1E2
FLAT_PLAIN, COMPRESSED_FULL, FLAT_INLINE, COMPRESSED_COMPACT, CHUNK_BASED = range(5)
S_IFMT, S_IFDIR, S_IFLNK, S_IFREG = 0o170000, 0o040000, 0o120000, 0o100000
MAX_INODES = 20_000_000


def _ranges_to_blocks(ranges: list[tuple[int, int]], bs: int) -> set[int]:
    out: set[int] = set()
    for off, length in ranges:
        if length > 0:
            out.update(range(off // bs, (off + length - 1) // bs + 1))
    return out


def metadata_blocks(path: Path) -> tuple[int, list[int]]:
    """Return (block size, sorted block numbers holding metadata) of the image at `path`."""
    with open(path, "rb") as f:
        data = f.read()       # images are read once at build; mmap would not be cheaper here
    return _metadata_blocks(memoryview(data))


def _metadata_blocks(img: memoryview) -> tuple[int, list[int]]:
    if len(img) < SUPER_OFFSET + 128:
        raise ValueError("too small to be an EROFS image")
    sb = img[SUPER_OFFSET:SUPER_OFFSET + 128]
    magic, = struct.unpack_from("<I", sb, 0)
    if magic != MAGIC:
        raise ValueError("no EROFS magic")
    blkszbits = sb[12]
    root_nid, = struct.unpack_from("<H", sb, 14)
    meta_blkaddr, xattr_blkaddr = struct.unpack_from("<II", sb, 40)
    if not 9 <= blkszbits <= 16:
        raise ValueError(f"odd block size bits {blkszbits}")
    bs = 1 << blkszbits
    size = len(img)
    meta_base = meta_blkaddr * bs
    ranges: list[tuple[int, int]] = [(0, SUPER_OFFSET + 128)]
    seen: set[int] = set()
    stack = [root_nid]
    while stack:
        nid = stack.pop()
        if nid in seen:
            continue
        seen.add(nid)
        if len(seen) > MAX_INODES:
            raise ValueError("too many inodes")
        pos = meta_base + nid * 32
        if pos + 32 > size:
            raise ValueError(f"inode {nid} beyond the end of the image")
        fmt, xicount, mode = struct.unpack_from("<HHH", img, pos)
        extended = fmt & 1
        layout = (fmt >> 1) & 7
        isize_hdr = 64 if extended else 32
        if extended:
            isize, = struct.unpack_from("<Q", img, pos + 8)
        else:
            isize, = struct.unpack_from("<I", img, pos + 8)
        raw_blkaddr, = struct.unpack_from("<I", img, pos + 16)
        xattr_size = 12 + (xicount - 1) * 4 if xicount else 0
        body = pos + isize_hdr + xattr_size
        ranges.append((pos, isize_hdr + xattr_size))
        if xicount:       # shared xattrs live in the xattr area; ids are 4-byte units
            shared_count = img[pos + isize_hdr + 4]
            for i in range(shared_count):
                sid, = struct.unpack_from("<I", img, pos + isize_hdr + 12 + 4 * i)
                ranges.append((xattr_blkaddr * bs + sid * 4, 64))
        kind = mode & S_IFMT
        if layout in (COMPRESSED_FULL, COMPRESSED_COMPACT, CHUNK_BASED):
            ranges.append((body, bs))          # the extent/chunk index right after the inode
            data_ranges: list[tuple[int, int]] = []
        elif layout == FLAT_INLINE:
            full = isize - isize % bs
            data_ranges = [(raw_blkaddr * bs, full)] if full else []
            if isize % bs:
                data_ranges.append((body, isize % bs))
        elif layout == FLAT_PLAIN:
            data_ranges = [(raw_blkaddr * bs, isize)] if isize else []
        else:
            raise ValueError(f"inode {nid}: unknown data layout {layout}")
        if kind == S_IFREG:
            if layout == FLAT_INLINE and isize % bs:
                ranges.append(data_ranges[-1])     # the tail sits in the inode's block anyway
            continue
        if kind == S_IFLNK:
            ranges.extend(data_ranges)
            continue
        if kind != S_IFDIR:
            continue
        if layout not in (FLAT_PLAIN, FLAT_INLINE):
            raise ValueError(f"directory inode {nid} uses unsupported layout {layout}")
        ranges.extend(data_ranges)
        for off, length in data_ranges:
            for boff in range(off, off + length, bs):
                blen = min(bs, off + length - boff)
                _dirents(img, boff, blen, stack, size)
    return bs, sorted(_ranges_to_blocks(ranges, bs))


def _dirents(img: memoryview, off: int, length: int, stack: list[int], size: int) -> None:
    if off + length > size or length < 12:
        raise ValueError("directory block beyond the image or too short")
    nameoff0, = struct.unpack_from("<H", img, off + 8)
    n = nameoff0 // 12
    if n == 0 or nameoff0 > length:
        raise ValueError("corrupt directory block")
    for i in range(n):
        nid, = struct.unpack_from("<Q", img, off + 12 * i)
        name_start, = struct.unpack_from("<H", img, off + 12 * i + 8)
        name_end = (struct.unpack_from("<H", img, off + 12 * (i + 1) + 8)[0]
                    if i + 1 < n else length)
        name = bytes(img[off + name_start:off + name_end]).rstrip(b"\0")
        if name in (b".", b".."):
            continue
        stack.append(nid)


__all__ = ["metadata_blocks"]
