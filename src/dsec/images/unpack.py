"""Unpack a tar archive beneath a directory so that nothing in it reaches outside.

Every archive dsec unpacks (image layers, `docker save` archives, uploaded build contexts and
OCI layouts, rootfs tarballs) goes through `unpack_beneath`. Two mechanisms, each enough for
the escape it stops:

* bsdtar (libarchive) runs with `--chroot`: it chroots into the target before it creates
  anything, so every path component and every link target -- including symlinks an earlier
  layer left in the tree -- resolves with the target as `/`, as Docker applies layers. A
  layer-1 symlink `x -> /var/tmp` plus a layer-2 file `x/canary` lands at `<root>/var/tmp/canary`;
  a hard link to `x/admin.key` where `x -> /var/lib/dsec` names `<root>/var/lib/dsec/admin.key`
  (missing: the import fails), never the host's file. GNU tar as root follows such symlinks.
* For untrusted archives, a Python filter rewrites the stream first (UntrustedRules): names
  with `..` are refused, leading `/` stripped, device nodes dropped, `trusted.*` xattrs
  (overlayfs metadata a layer could forge) dropped, and for plain uploads (build contexts,
  OCI layouts) owners, setuid/setgid/sticky bits, devices, FIFOs and all xattrs dropped too.

Layers keep their setuid bits, owners and `security.capability`: inside a sandbox they act only
within its user namespace, and every host-side mount of a layer is nosuid,nodev (mounts.py).

`resolve_beneath` gives Python code the same chroot semantics for the paths it touches itself
(whiteouts, opaque markers).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path, PurePosixPath
from typing import IO

from dsec.types import InvalidArgument, Unavailable

from .progress import Progress, report

log = logging.getLogger("dsec.images.unpack")

MAX_LINKS = 40                   # symlinks followed in one lookup (the kernel's own limit)
COPY_BUF = 1 << 20
XATTR_KEYS = ("SCHILY.xattr.", "LIBARCHIVE.xattr.")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class UntrustedRules:
    """How an untrusted archive is rewritten before bsdtar sees it."""

    skip_prefix: str | None = None   # member basenames to leave out (".wh." for OCI layers)
    plain: bool = False              # a plain upload: no owners, special bits, devices or xattrs
    devices: bool = False            # keep device nodes (a rootfs tarball the operator made)
    max_bytes: int | None = None     # refuse an archive whose files add up to more (a tar bomb)


LAYER_RULES = UntrustedRules(skip_prefix=".wh.")
UPLOAD_RULES = UntrustedRules(plain=True)
# What an untrusted archive may unpack to: its own size times this plus a margin (a 305 KB xz
# build context once unpacked to 2.18 GiB).
UNPACKED_RATIO = 200
UNPACKED_MARGIN = 256 << 20


def bounded(rules: UntrustedRules, archive: Path, cap: int | None = None) -> UntrustedRules:
    """`rules` with max_bytes set from the archive's size (and at most `cap`)."""
    limit = UNPACKED_MARGIN + UNPACKED_RATIO * archive.stat().st_size
    return replace(rules, max_bytes=min(limit, cap) if cap is not None else limit)
ROOTFS_RULES = UntrustedRules(devices=True)


def bsdtar_binary() -> str:
    path = shutil.which("bsdtar")
    if path is None:
        raise Unavailable("bsdtar is not installed on this node; dsec unpacks archives with it "
                          "(chrooted into the target)",
                          fix="apt-get install -y libarchive-tools (scripts/install.sh installs it)")
    return path


def clean_name(name: str, *, field: str, what: str) -> str | None:
    """A member name relative to the archive's root: leading '/' and '.' parts dropped, '..'
    refused (with chroot it could not escape, but no honest archive has it). None: the root."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidArgument(f"{what}: member {name!r} has a '..' component and would land "
                              "outside the root directory", field=field,
                              fix="rebuild the archive from inside its root (e.g. `tar -C root -cf x.tar .`) "
                                  "so every member name is relative and free of '..'")
    return "/".join(parts) or None


def resolve_beneath(root: Path, rel: PurePosixPath | str) -> Path | None:
    """root/rel with every symlink in rel's parent followed as if root were `/` (chroot
    semantics; the last component itself is not followed). None when a parent is missing,
    is not a directory, or the links loop."""
    parts = [p for p in str(rel).split("/") if p not in ("", ".")]
    if not parts:
        return None
    last = parts.pop()
    done: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        cur = root.joinpath(*done, part)
        try:
            st = os.lstat(cur)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                return None
            target = os.readlink(cur)
            if target.startswith("/"):
                done = []
            parts = target.split("/") + parts
            continue
        if not stat.S_ISDIR(st.st_mode):
            return None
        done.append(part)
    if last == "..":
        return None
    return root.joinpath(*done, last)


class _Counting:
    """A read-only file wrapper that reports how far it has read."""

    def __init__(self, f: IO[bytes], size: int, label: str, progress: Progress | None):
        self.f, self.size, self.label, self.progress = f, max(size, 1), label, progress
        self.done = 0
        self.last = 0.0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.done += len(data)
        if self.progress is not None and time.monotonic() - self.last > 0.5:
            self.last = time.monotonic()
            report(self.progress, f"extracting {self.label}", min(self.done / self.size, 1.0))
        return data


def _sanitized(members: Iterable[tarfile.TarInfo], rules: UntrustedRules, *, field: str,
               what: str, root: list[tarfile.TarInfo]) -> Iterable[tarfile.TarInfo]:
    """The members bsdtar may see, rewritten by `rules` (counts of what was dropped logged).
    The archive's own root entry ("./") goes to `root` instead: bsdtar, chrooted there, does
    not apply it, so the caller does."""
    dropped: dict[str, int] = {}
    total = 0
    for m in members:
        total += m.size if m.isreg() else 0
        if rules.max_bytes is not None and total > rules.max_bytes:
            raise InvalidArgument(f"{what} unpacks to more than {rules.max_bytes >> 20} MiB", field=field,
                                  fix="send a smaller archive (leave out what the build does not need)")
        name = clean_name(m.name, field=field, what=what)
        if name is None:
            if m.isdir() and not rules.plain:
                root[:] = [m]
            continue
        if rules.skip_prefix and name.rsplit("/", 1)[-1].startswith(rules.skip_prefix):
            continue
        if ((m.ischr() or m.isblk()) and not rules.devices) or (rules.plain and m.isfifo()):
            dropped["device/fifo"] = dropped.get("device/fifo", 0) + 1
            continue
        if m.islnk():
            link = clean_name(m.linkname, field=field, what=what)
            if link is None:
                raise InvalidArgument(f"{what}: hard link {m.name!r} points at the archive's root",
                                      field=field, fix="a hard link must name an earlier file")
            m.linkname = link
        m.name = name
        for k in list(m.pax_headers):
            if k.startswith(XATTR_KEYS) and (rules.plain or k.split(".xattr.", 1)[1].startswith("trusted.")):
                del m.pax_headers[k]
                dropped["xattr"] = dropped.get("xattr", 0) + 1
        if rules.plain:
            m.mode &= 0o755
            m.uid = m.gid = 0
            m.uname = m.gname = ""
            for k in ("uid", "gid", "uname", "gname"):
                m.pax_headers.pop(k, None)
        if m.issparse():                  # written back as the plain file it stands for
            m.type, m.sparse = tarfile.REGTYPE, None
        yield m
    if dropped:
        log.info("%s: left out %s", what, ", ".join(f"{n} {k}" for k, n in dropped.items()))


def _feed_sanitized(src: IO[bytes], out: IO[bytes], rules: UntrustedRules, *, field: str,
                    what: str, root: list[tarfile.TarInfo]) -> None:
    try:
        tin = tarfile.open(fileobj=src, mode="r|*")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise InvalidArgument(f"{what} is not a usable tar archive ({e})", field=field,
                              fix="send a tar (optionally gzip/xz/bzip2/zstd-compressed)") from None
    tout = tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, copybufsize=COPY_BUF)
    try:
        for m in _sanitized(tin, rules, field=field, what=what, root=root):
            tout.addfile(m, tin.extractfile(m) if m.isreg() else None)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise InvalidArgument(f"{what} is corrupt or truncated ({e})", field=field,
                              fix="send a complete archive (`tar -tf FILE` must list it cleanly)") from None
    finally:
        tout.close()
        tin.close()


def unpack_beneath(archive: Path, dest: Path, *, field: str, what: str | None = None,
                   rules: UntrustedRules | None = None, progress: Progress | None = None) -> None:
    """Extract `archive` into `dest` with bsdtar chrooted into `dest`. `rules`: rewrite an
    untrusted archive first (see module doc); None: a trusted one is passed through as is.
    Raises InvalidArgument(field) for any archive error; dest may then hold a partial tree."""
    archive = Path(archive)
    what = what or f"archive {archive.name}"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [bsdtar_binary(), "-x", "-f", "-", "-C", str(dest), "--chroot", "-P", "--numeric-owner"]
    cmd += ["-o"] if rules is not None and rules.plain else ["-p", "--xattrs", "--acls"]
    size = archive.stat().st_size
    report(progress, f"extracting {archive.name}", 0.0, level=logging.INFO)
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as errf, open(archive, "rb") as raw:
        src: IO[bytes] = _Counting(raw, size, archive.name, progress)     # type: ignore[assignment]
        unzstd = None
        if rules is not None and raw.read(4) == ZSTD_MAGIC:
            if shutil.which("zstd") is None:
                raise Unavailable("zstd archives need the zstd program", fix="apt-get install -y zstd")
            raw.seek(0)
            unzstd = subprocess.Popen(["zstd", "-dc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)
            pump = threading.Thread(target=_pump, args=(src, unzstd.stdin), daemon=True)
            pump.start()
            src = unzstd.stdout                                               # type: ignore[assignment]
        else:
            raw.seek(0)
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errf,
                                env=dict(os.environ, LC_ALL="C.UTF-8"))   # names in PAX headers are UTF-8
        assert proc.stdin is not None
        failure: BaseException | None = None
        root: list[tarfile.TarInfo] = []
        try:
            if rules is None:
                while chunk := src.read(COPY_BUF):
                    proc.stdin.write(chunk)
            else:
                _feed_sanitized(src, proc.stdin, rules, field=field, what=what, root=root)
        except BrokenPipeError:
            pass                                   # bsdtar gave up; its stderr says why
        except BaseException as e:                 # our refusal, or a read error: bsdtar stops too
            failure = e
            proc.kill()
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
            if unzstd is not None:
                unzstd.kill()
                unzstd.wait()
        rc = proc.wait()
        errf.seek(0)
        err = errf.read().decode(errors="replace").strip()
    if failure is not None:
        if isinstance(failure, OSError) and not isinstance(failure, BrokenPipeError):
            raise InvalidArgument(f"{what}: read error ({failure})", field=field,
                                  fix="send a complete, readable archive") from None
        raise failure
    if rc != 0:
        lines = [ln.removeprefix("bsdtar: ") for ln in err.splitlines() if ln.strip()
                 and "Error exit delayed" not in ln][-6:]
        why = "; ".join(lines) or f"bsdtar exited with status {rc}"
        raise InvalidArgument(f"cannot extract {what}: {why}", field=field,
                              fix="send a complete archive whose links name files inside it "
                                  "(`tar -tvf FILE` must list it cleanly)")
    if err:
        log.warning("bsdtar warnings while extracting %s: %s", what, err[-2000:])
    for m in root:                   # the archive's "./": its owner, mode and time on dest
        os.chown(dest, m.uid, m.gid)
        os.chmod(dest, m.mode & 0o7777)
        ns = _mtime_ns(m)
        os.utime(dest, ns=(ns, ns))
    report(progress, f"extracted {archive.name} in {time.monotonic() - t0:.1f}s", 1.0, level=logging.INFO)


def _mtime_ns(m: tarfile.TarInfo) -> int:
    """A member's mtime in ns, exact: a PAX mtime has ns digits that a float loses (and the
    image digest would change with them)."""
    raw = m.pax_headers.get("mtime")
    return int(Decimal(raw) * 1_000_000_000) if raw else int(m.mtime) * 1_000_000_000


def _pump(src: IO[bytes], dst: IO[bytes] | None) -> None:
    assert dst is not None
    try:
        while chunk := src.read(COPY_BUF):
            dst.write(chunk)
    except (BrokenPipeError, ValueError, OSError):
        pass
    finally:
        try:
            dst.close()
        except OSError:
            pass
