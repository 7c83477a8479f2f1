"""Build an image from a Dockerfile with buildah, into dsec's layer store.

    build_dockerfile(svc, "myenv", "ctx/")  ->  (ImageInfo, ImageConfig)

How (docs/decisions.md, D37):
1. Parse the Dockerfile's FROM lines (and `COPY --from=IMAGE`): every base must be a dsec image
   (there is no registry to pull from). Each is exported once per image digest from its mounted
   EROFS layers to an OCI layout and pulled into dsec's own containers-storage
   ($DSEC_HOME/buildah, overlay driver) as `localhost/dsec-base-<digest>`; FROM lines are
   rewritten to that name in a copy of the Dockerfile. A base dsec does not have is an
   InvalidArgument naming the line, the image and the fix, before buildah runs.
2. `buildah bud` with `--pull=never`, RUN steps in an OCI container (crun) inside a user
   namespace whose root is an unprivileged host uid range (never host root), no network
   (`--network none`) unless the caller allows it, a memory and pids limit, and a deadline.
   buildah itself (every command: pull, bud, push, rmi...) runs as root of a user namespace of
   unprivileged host ids (BUILDAH_IDS) in namespaces of its own (build_jail.py); its storage,
   and the context and scratch dir it reads, are owned by that namespace's root.
3. `buildah push` the result to an OCI layout, then ImageService.import_oci (the existing,
   all-or-nothing import), then `buildah rmi`. The image's config (ENV, WORKDIR, USER, CMD,
   ENTRYPOINT) is kept beside the store (image_config / save_config): dsec images carry no
   config, so clients that start sandboxes from a built image pass env/workdir from it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import tarfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from dsec.config import Paths
from dsec.types import (Conflict, DsecError, ImageBuildResult, ImageConfig, ImageInfo, InvalidArgument, NotFound,
                        Unavailable)

from .build_jail import Bind, IdRange, build_cgroups, jailed, userns_helper
from .builder import safe_rmtree, scratch_dir
from .mounts import sys_mount, sys_umount
from .progress import Progress, report
from .service import ImageService
from .store import FileLock, check_may_replace, check_name

log = logging.getLogger("dsec.images.dockerfile")

# RUN steps' host id range: one 65536-id slot per concurrent build, below the sandboxes' ranges
# (backends/container/idmap.py starts at 2^28) and far above real host users. Fixed, not a
# setting: buildah's storage is owned by the id above the slots, so moving them would orphan it.
BUILD_ID_FIRST = 1 << 27
BUILD_ID_RANGE = 65536
BUILD_SLOTS = 64
BUILD_SLOT_DIR = Path("/run/dsec/build-idranges")     # one flock-ed file per slot in use
# buildah's own user namespace (build_jail.py): its root and 0..65535 are the host ids just
# above the slots, and the slots' host ids are mapped to themselves, so RUN steps' maps
# (0:SLOT:65536) mean the same host ids inside it as outside. Its storage is owned by that root.
BUILDAH_ROOT_ID = BUILD_ID_FIRST + BUILD_SLOTS * BUILD_ID_RANGE
BUILDAH_IDS = (IdRange(0, BUILDAH_ROOT_ID, BUILD_ID_RANGE),
               IdRange(BUILD_ID_FIRST, BUILD_ID_FIRST, BUILD_SLOTS * BUILD_ID_RANGE))
DEFAULT_TIMEOUT_S = 1800
BUILD_PIDS = 8192          # a build's processes, buildah's and its RUN steps' together
STORAGE_DRIVER = "overlay"   # buildah's storage (unprivileged overlay mounts inside its user namespace)
LOG_TAIL_LINES = 40
SIGNATURE_POLICY = {"default": [{"type": "insecureAcceptAnything"}]}   # local layouts only


# ---------------------------------------------------------------------------------------
# buildah
# ---------------------------------------------------------------------------------------


def buildah_binary() -> str:
    path = shutil.which("buildah")
    if path is None:
        raise Unavailable("buildah is not installed on this node; it builds images from Dockerfiles",
                          fix="apt-get install buildah (scripts/install.sh installs it)")
    return path


@dataclass
class Buildah:
    """buildah on dsec's own storage (never the host's /var/lib/containers), run as root of a
    user namespace of unprivileged host ids (BUILDAH_IDS) that owns its storage."""

    root: Path
    policy: Path
    helper: Path
    log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))

    @classmethod
    def for_home(cls, paths: Paths) -> "Buildah":
        base = paths.home / "buildah"
        base.mkdir(parents=True, exist_ok=True)
        base.chmod(0o711)    # buildah's root and RUN steps' root (mapped uids) traverse it; no listing
        with FileLock(base / ".owner.lock"):
            for sub in ("storage", "run", "tmp"):
                _owned_by_buildah(base / sub)
        policy = base / "policy.json"
        if not policy.is_file():
            tmp = base / f".policy.{os.getpid()}"
            tmp.write_text(json.dumps(SIGNATURE_POLICY))
            tmp.chmod(0o644)     # read by buildah's root, an unprivileged host uid
            tmp.replace(policy)
        policy.chmod(0o644)      # one written before buildah ran unprivileged was 0600
        return cls(root=base, policy=policy, helper=userns_helper(paths.bin))

    def argv(self, *args: str, binds: Sequence[Bind] = (), cwd: Path | None = None,
             cgroups: Sequence[Path] = ()) -> list[str]:
        """buildah ARGS in the build's own namespaces (build_jail.py), seeing its storage and
        `binds` only."""
        cmd = [buildah_binary(), "--root", str(self.root / "storage"), "--runroot",
               str(self.root / "run"), "--storage-driver", STORAGE_DRIVER, *args]
        return jailed(cmd, root=self.root / "jail", binds=[Bind(self.root, writable=True), *binds], cwd=cwd,
                      ids=BUILDAH_IDS, helper=self.helper, cgroups=cgroups)

    def env(self) -> dict[str, str]:
        # no host registries config: nothing resolves a short name to a remote registry
        return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "HOME": str(self.root / "tmp"),
                "LANG": "C.UTF-8", "BUILDAH_ISOLATION": "oci", "TMPDIR": str(self.root / "tmp"),
                "CONTAINERS_REGISTRIES_CONF": str(self._registries())}

    def _registries(self) -> Path:
        conf = self.root / "registries.conf"
        if not conf.is_file():
            tmp = self.root / f".registries.{os.getpid()}"
            tmp.write_text('unqualified-search-registries = []\nshort-name-mode = "disabled"\n')
            tmp.chmod(0o644)
            tmp.replace(conf)
        conf.chmod(0o644)
        return conf

    def run(self, *args: str, timeout_s: float = 600, progress: Progress | None = None,
            what: str = "buildah", cwd: Path | None = None, binds: Sequence[Bind] = (),
            cgroups: Sequence[Path] = ()) -> str:
        """Run buildah; its output lines go to progress and the log tail. Raises on failure."""
        argv = self.argv(*args, binds=binds, cwd=cwd, cgroups=cgroups)
        log.debug("running buildah %s (in its own namespaces)", shlex.join(args))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True,
                                umask=0o022)   # RUN steps' mapped root walks buildah's dirs
        # a watchdog, not a check per output line: a silent step must time out too
        fired = threading.Event()

        def expire() -> None:
            fired.set()
            _kill_group(proc)
        watchdog = threading.Timer(timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        out: list[str] = []
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                out.append(line)
                self.log_tail.append(line)
                report(progress, line[:300])
            proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                _kill_group(proc)
        if fired.is_set():
            self.cleanup_after_kill()
            raise DsecError(f"{what} ran past its {timeout_s:.0f} s deadline and was stopped; "
                            f"last output:\n{self.tail()}", field="timeout_s",
                            fix="raise timeout_s, or make the slow step faster")
        if proc.returncode != 0:
            raise _BuildahFailed(proc.returncode, "\n".join(out[-LOG_TAIL_LINES:]))
        return "\n".join(out)

    def cleanup_after_kill(self) -> None:
        """A killed buildah leaves its working container (and its overlay mount). Remove all
        of them, but only when no other build runs on this node (theirs would go too)."""
        if _other_builds_running():
            log.warning("a killed build left a working container; another build runs, not removing")
            return
        subprocess.run(self.argv("rm", "--all"), capture_output=True, env=self.env(), timeout=120)

    def tail(self) -> str:
        return "\n".join(self.log_tail)

    def has_image(self, ref: str) -> bool:
        r = subprocess.run(self.argv("inspect", "--type", "image", "--format", "{{.FromImageID}}", ref),
                           capture_output=True, env=self.env(), timeout=120)
        return r.returncode == 0


def give_to_buildah(path: Path) -> None:
    """Make a tree dsec wrote (a scratch dir, an uploaded context) buildah's: its root is an
    unprivileged host id that could not read host root's 0600 files. Links are not followed."""
    uid = BUILDAH_ROOT_ID
    os.lchown(path, uid, uid)
    for top, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(top, n), uid, uid)


def take_back(layout: Path) -> None:
    """Make the layout buildah wrote (as an unprivileged uid, in a dir it owned) host root's
    before host root reads and rewrites it: a symlink or special file there would be followed
    by host root on the host (a buildah that a build subverted could plant one). Nothing of
    the build runs any more (its pid namespace is gone), so nothing changes it after the check."""
    for top, dirs, files in os.walk(layout):
        for p in [top, *(os.path.join(top, n) for n in dirs + files)]:
            st = os.lstat(p)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise DsecError(f"the build's output {p} is neither a file nor a directory; refused",
                                fix="report this build: buildah does not write links into an OCI layout")
            os.lchown(p, 0, 0)
    if not os.path.isdir(layout) or os.path.islink(layout):
        raise DsecError(f"the build's output {layout} is not a directory; refused")


def _owned_by_buildah(path: Path) -> None:
    """`path` (storage, run or tmp) as a directory owned by buildah's root. Storage from before
    buildah ran in a user namespace (owned by host root, unusable from inside) is a cache of
    base images: it is dropped, and bases are exported again as builds need them."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    if st is not None and st.st_uid != BUILDAH_ROOT_ID:
        old = path.with_name(f".{path.name}.old-{secrets.token_hex(4)}")
        path.rename(old)
        log.info("dropping %s: made by buildah as host root (a base-image cache)", path)
        safe_rmtree(old)
        st = None
    if st is None:
        path.mkdir(mode=0o700)
        os.chown(path, BUILDAH_ROOT_ID, BUILDAH_ROOT_ID)
        path.chmod(0o711)     # RUN steps' root (another mapped uid) walks to its rootfs


class _BuildahFailed(DsecError):
    """buildah failed: the message carries its last output lines."""

    def __init__(self, rc: int, tail: str):
        super().__init__(f"buildah exited {rc}: {tail[-3000:]}", fix="see the message; the server log has the command")
        self.rc, self.tail = rc, tail


def _other_builds_running() -> bool:
    """Whether any build slot other than ours is held (flock)."""
    held = 0
    for slot in range(BUILD_SLOTS):
        path = BUILD_SLOT_DIR / str(slot)
        if not path.exists():
            continue
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            held += 1
        finally:
            os.close(fd)
    return held > 1


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---------------------------------------------------------------------------------------
# Dockerfile bases
# ---------------------------------------------------------------------------------------

_FROM_RE = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_COPY_FROM_RE = re.compile(r"^(\s*(?:COPY|ADD)\s+(?:--\S+\s+)*?--from=)(\S+)(.*)$", re.IGNORECASE)
_AS_RE = re.compile(r"^\s+AS\s+(\S+)\s*$", re.IGNORECASE)


@dataclass
class BaseRef:
    line: int          # 1-based line of the Dockerfile
    name: str          # the dsec image it names


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line as it is, raw, as rewrite_bases sees them (FROM never
    spans lines in practice; RUN bodies are not rewritten). `instructions` joins continuations
    for the checks that must see whole instructions."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        out.append((i, line))
    return out


def find_bases(text: str) -> tuple[list[BaseRef], list[str]]:
    """The dsec images a Dockerfile builds on, and its stage names. Raises InvalidArgument for
    a FROM this build cannot resolve (variables)."""
    stages: list[str] = []
    bases: list[BaseRef] = []
    for n, line in _logical_lines(text):
        m = _FROM_RE.match(line)
        if m:
            ref = m.group(3)
            alias = _AS_RE.match(m.group(4))
            if "$" in ref:
                raise InvalidArgument(f"Dockerfile line {n}: FROM {ref} uses a build variable; dsec "
                                      "resolves FROM to its own images before the build", field="dockerfile",
                                      fix="write the dsec image name literally, e.g. FROM debian-python")
            if ref.lower() != "scratch" and ref not in stages:
                bases.append(BaseRef(n, ref))
            if alias:
                stages.append(alias.group(1))
            continue
        m = _COPY_FROM_RE.match(line)
        if m and m.group(2) not in stages and not m.group(2).isdigit():
            bases.append(BaseRef(n, m.group(2)))
    if not any(_FROM_RE.match(line) for _, line in _logical_lines(text)):
        raise InvalidArgument("the Dockerfile has no FROM line", field="dockerfile",
                              fix="start it with FROM <dsec image>, e.g. FROM debian-python")
    return bases, stages


_DIRECTIVE_RE = re.compile(r"^#\s*([A-Za-z]+)\s*=\s*(\S+)\s*$")
_URL_RE = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*://|git@)")

def _run_flag_allowed(word: str) -> bool:
    w = word.lower()
    return "$" not in w and (w == "--network=none" or w.partition(",")[0] == "--mount=type=tmpfs")


def instructions(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with continuation lines joined (the `# escape=`
    directive honoured) and comments dropped, as buildah reads them."""
    lines = text.splitlines()
    esc = "\\"
    for line in lines:                       # parser directives come first, before anything else
        m = _DIRECTIVE_RE.match(line.strip())
        if not m:
            break
        if m.group(1).lower() == "escape":
            esc = m.group(2)
    out: list[tuple[int, str]] = []
    cur: str | None = None
    start = 0
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#") or (cur is None and not stripped):
            continue
        if cur is None:
            cur, start = "", n
        if stripped.endswith(esc):
            cur += stripped[:-len(esc)] + " "
            continue
        out.append((start, (cur + stripped).strip()))
        cur = None
    if cur:
        out.append((start, cur.strip()))
    return out


def _refuse(n: int, what: str, why: str, fix: str) -> InvalidArgument:
    return InvalidArgument(f"Dockerfile line {n}: {what}: {why}", field="dockerfile", fix=fix)


def _add_sources(rest: str) -> list[str]:
    words = rest.split()
    while words and words[0].startswith("--"):
        words.pop(0)
    if rest.lstrip().startswith("[") or (words and words[0].startswith("[")):
        try:
            parts = json.loads(rest[rest.index("["):])
            return [str(p) for p in parts[:-1]] if isinstance(parts, list) else []
        except ValueError:
            return words[:-1]
    return words[:-1]


def check_instructions(text: str) -> None:
    """Refuse what a build on a shared node may not do, naming the line (issue 22):
    `RUN --mount` other than tmpfs (bind and cache mounts reach paths outside the build in
    buildah 1.28; `from=` saw the host's root), RUN flags beyond --network=none, and `ADD` of a
    URL or git repository (fetched from the node's network, not through sandbox egress)."""
    for n, ins in instructions(text):
        op, _, rest = ins.partition(" ")
        op = op.upper()
        if op == "ONBUILD":
            op, _, rest = rest.strip().partition(" ")
            op = op.upper()
        if op == "RUN":
            for word in rest.split():
                if not word.startswith("--"):
                    break
                if not _run_flag_allowed(word):
                    raise _refuse(n, f"RUN {word}", "this RUN option is not allowed on dsec (bind and "
                                  "cache mounts can reach outside the build; RUN steps have no network)",
                                  "COPY what the step needs into the image first (COPY --from=STAGE for "
                                  "another stage's files); only --mount=type=tmpfs is allowed")
        elif op == "ADD":
            for src in _add_sources(rest):
                if _URL_RE.match(src):
                    raise _refuse(n, f"ADD {src}", "ADD of a URL is refused: builds fetch nothing from "
                                  "the network", "download the file into the build context and ADD or COPY "
                                  "it from there")


def base_tag(info: ImageInfo) -> str:
    return f"localhost/dsec-base-{info.digest.removeprefix('sha256:')[:24]}:latest"


def rewrite_bases(text: str, tags: dict[str, str], stages: list[str]) -> str:
    """The Dockerfile with every FROM / COPY --from naming a dsec image pointed at its tag."""
    out = []
    for line in text.splitlines():
        m = _FROM_RE.match(line)
        if m and m.group(3) in tags and m.group(3) not in stages:
            line = f"{m.group(1)}{m.group(2)}{tags[m.group(3)]}{m.group(4)}"
        else:
            m = _COPY_FROM_RE.match(line)
            if m and m.group(2) in tags and m.group(2) not in stages:
                line = f"{m.group(1)}{tags[m.group(2)]}{m.group(3)}"
        out.append(line)
    return "\n".join(out) + "\n"


def resolve_bases(svc: ImageService, bases: list[BaseRef],
                  usable: Callable[[ImageInfo], bool] | None = None) -> dict[str, ImageInfo]:
    """The dsec image of every base; one the caller may not use looks missing (tenancy)."""
    found: dict[str, ImageInfo] = {}
    for b in bases:
        if b.name in found:
            continue
        try:
            info = svc.get(b.name)
            if usable is not None and not usable(info):
                raise NotFound(b.name)
        except NotFound:
            from dsec.images.builtin import BUILTIN_IMAGES
            # dsec's built-in images first (the usual bases), then others, at most 8
            names = sorted((i.name for i in svc.list() if i.kind == "image" and (usable is None or usable(i))),
                           key=lambda n: (n not in BUILTIN_IMAGES, n))[:8]
            raise NotFound(
                f"Dockerfile line {b.line}: FROM {b.name}: no dsec image {b.name!r} on this node, and "
                "builds cannot pull from registries", field="dockerfile",
                fix=f"FROM one of the local images ({', '.join(names) or 'none built yet'}), or bring "
                    f"{b.name} in first: dsec image pull {b.name} docker://REGISTRY/{b.name} or "
                    f"dsec image import {b.name} --docker-archive TAR (docker save)") from None
        if info.kind != "image":
            raise InvalidArgument(f"Dockerfile line {b.line}: {b.name} is a {info.kind}, not a base image",
                                  field="dockerfile", fix="FROM a base image (dsec image ls)")
        found[b.name] = info
    return found


@contextmanager
def _merged_view(svc: ImageService, info: ImageInfo, work: Path) -> Iterator[Path]:
    """The image's root tree: its one mounted layer, or a read-only overlay of all of them."""
    dirs = svc.mount_image(info.name)
    if len(dirs) == 1:
        yield dirs[0]
        return
    target = work / "merged"
    target.mkdir()
    lower = ":".join(str(d) for d in reversed(dirs))     # overlay: topmost first
    sys_mount("overlay", str(target), "overlay", 0x1, f"lowerdir={lower}")
    try:
        yield target
    finally:
        sys_umount(str(target))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _put_blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest[7:]).write_bytes(data)
    return digest, len(data)


def _top_entries(root: Path) -> list[str]:
    """The root's entries, without "." itself: a layer whose tar holds "./" keeps that entry's
    owner (host root) on the root dir of buildah's id-mapped copy, and RUN steps' root (a mapped
    uid) could then not create /run or any other top-level directory."""
    return sorted(os.listdir(root))


def export_oci(svc: ImageService, info: ImageInfo, layout: Path, work: Path, tag: str = "latest") -> None:
    """Write the dsec image as a one-layer OCI image layout (uncompressed tar layer)."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    tar = work / "layer.tar"
    with _merged_view(svc, info, work) as root:
        r = subprocess.run(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls",
                            "--one-file-system", "-C", str(root), "-cf", str(tar), "--", *_top_entries(root)],
                           capture_output=True, text=True)
    if r.returncode not in (0, 1):       # 1: "file changed as we read it" cannot happen on EROFS
        raise DsecError(f"exporting {info.name} for the build failed: {r.stderr[-2000:]}")
    digest = _sha256(tar)
    size = tar.stat().st_size
    tar.rename(blobs / digest[7:])
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
              "rootfs": {"type": "layers", "diff_ids": [digest]}}
    cdig, csize = _put_blob(layout, json.dumps(config).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdig, "size": csize},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": size}]}
    mdig, msize = _put_blob(layout, json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdig, "size": msize,
         "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    (layout / "index.json").write_text(json.dumps(index))


def ensure_base(svc: ImageService, bah: Buildah, info: ImageInfo, progress: Progress | None) -> str:
    """The dsec image in buildah's storage (exported once per image digest); returns its tag."""
    tag = base_tag(info)
    with FileLock(bah.root / f".base-{info.digest[7:23]}.lock"):
        if bah.has_image(tag):
            return tag
        report(progress, f"exporting {info.name} ({info.digest[:19]}) as a build base", None, level=logging.INFO)
        with scratch_dir(svc.paths, "base") as work:
            # buildah 1.28 names an image pulled from an OCI layout after the layout's path, which
            # must then be a valid reference: no upper case, no trailing "_" (a DSEC_HOME or a
            # mkdtemp name may have both). So the layout is pulled by a relative, lower-hex name.
            layout = f"l{secrets.token_hex(8)}"
            export_oci(svc, info, work / layout, work)
            give_to_buildah(work)
            # pulled from an OCI layout the image has no name: --quiet prints its id, tag that
            out = bah.run("pull", "--signature-policy", str(bah.policy), "--quiet",
                          f"oci:{layout}:latest", progress=progress, what="buildah pull", cwd=work,
                          binds=[Bind(work)])
            image_id = out.strip().splitlines()[-1] if out.strip() else ""
            if not re.fullmatch(r"[0-9a-f]{64}", image_id):
                raise DsecError(f"buildah pull of {info.name} printed no image id: {out[-500:]}")
            bah.run("tag", image_id, tag, what="buildah tag")
            # the pull also named the image after the layout's path: drop that name (rmi of one
            # of several names only untags)
            subprocess.run(bah.argv("rmi", f"localhost/{layout}:latest"), capture_output=True,
                           env=bah.env(), timeout=120)
    return tag


def prune_bases(svc: ImageService, bah: Buildah) -> None:
    """Drop exported bases whose dsec image digest no image has any more (best effort)."""
    live = {base_tag(i) for i in svc.list()}
    r = subprocess.run(bah.argv("images", "--noheading", "--format", "{{.Name}}:{{.Tag}}"),
                       capture_output=True, text=True, env=bah.env())
    for name in r.stdout.split():
        if name.startswith("localhost/dsec-base-") and name not in live:
            subprocess.run(bah.argv("rmi", "-f", name), capture_output=True, env=bah.env())


# ---------------------------------------------------------------------------------------
# The build's id range
# ---------------------------------------------------------------------------------------


@contextmanager
def build_id_range() -> Iterator[int]:
    """A host id range no other build uses now (flock: freed when the build's process dies)."""
    BUILD_SLOT_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    for slot in range(BUILD_SLOTS):
        fd = os.open(BUILD_SLOT_DIR / str(slot), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield BUILD_ID_FIRST + slot * BUILD_ID_RANGE
        finally:
            os.close(fd)
        return
    raise Unavailable(f"{BUILD_SLOTS} image builds already run on this node", fix="retry when one has finished")


# ---------------------------------------------------------------------------------------
# Config kept beside the store
# ---------------------------------------------------------------------------------------


def _config_file(paths: Paths, digest: str) -> Path:
    return paths.home / "image-configs" / f"{digest.removeprefix('sha256:')}.json"


def save_config(paths: Paths, digest: str, config: ImageConfig) -> None:
    f = _config_file(paths, digest)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(config.model_dump_json())
    tmp.replace(f)


def image_config(svc: ImageService, name: str) -> ImageConfig:
    """The config a Dockerfile gave the image; empty for images built otherwise."""
    info = svc.get(name)
    f = _config_file(svc.paths, info.digest)
    return ImageConfig.model_validate_json(f.read_text()) if f.is_file() else ImageConfig()


def config_from_layout(layout: Path) -> ImageConfig:
    index = json.loads((layout / "index.json").read_text())
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    cfg = json.loads((blobs / manifest["config"]["digest"][7:]).read_text()).get("config") or {}
    env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
    return ImageConfig(env=env, workdir=cfg.get("WorkingDir") or None, user=cfg.get("User") or None,
                       entrypoint=cfg.get("Entrypoint") or [], cmd=cfg.get("Cmd") or [],
                       labels=cfg.get("Labels") or {})


# ---------------------------------------------------------------------------------------
# Layers written by RUN steps: back to the image's own ids
# ---------------------------------------------------------------------------------------


def _mapped(tar: Path, first: int, count: int) -> bool:
    with tarfile.open(tar, "r:*") as tf:
        return any(first <= m.uid < first + count or first <= m.gid < first + count for m in tf)


def _unmap_tar(src: Path, dst: Path, first: int, count: int) -> None:
    """Copy a layer tar with owners in the build's host id range moved back to 0..count-1
    (buildah 1.28 with overlay and a userns map commits RUN steps' files with host ids)."""
    with tarfile.open(src, "r:*") as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for m in tin:
            if first <= m.uid < first + count:
                m.uid -= first
            if first <= m.gid < first + count:
                m.gid -= first
            for k in ("uid", "gid", "uname", "gname"):   # PAX copies would override the fields
                m.pax_headers.pop(k, None)
            m.uname = m.gname = ""
            tout.addfile(m, tin.extractfile(m) if m.isreg() else None)


def unmap_layout(layout: Path, first: int, count: int) -> None:
    """Rewrite the layout's layers whose files carry the build's host ids (manifest and index
    follow the new digests)."""
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    mdesc = index["manifests"][0]
    manifest = json.loads((blobs / mdesc["digest"][7:]).read_text())
    changed = False
    for lay in manifest["layers"]:
        src = blobs / lay["digest"][7:]
        if not _mapped(src, first, count):
            continue
        tmp = blobs / ".unmap.tmp"
        _unmap_tar(src, tmp, first, count)
        digest = _sha256(tmp)
        tmp.rename(blobs / digest[7:])
        lay.update(digest=digest, size=(blobs / digest[7:]).stat().st_size,
                   mediaType="application/vnd.oci.image.layer.v1.tar")
        changed = True
    if changed:
        mdig, msize = _put_blob(layout, json.dumps(manifest).encode())
        mdesc.update(digest=mdig, size=msize)
        (layout / "index.json").write_text(json.dumps(index))


# ---------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------


def _check_context(context: Path, dockerfile: str) -> Path:
    if not context.is_dir():
        raise InvalidArgument(f"{context} is not a directory", field="dockerfile",
                              fix="pass the build context: the directory that holds the Dockerfile")
    df = (context / dockerfile).resolve()
    if not df.is_relative_to(context.resolve()) or not df.is_file():
        raise InvalidArgument(f"no Dockerfile {dockerfile!r} in {context}", field="dockerfile",
                              fix="put a file named Dockerfile in the directory, or name it with --file")
    return df


def _buildah_context(paths: Paths, ctx: Path, work: Path) -> Path:
    """The context as buildah's root may read it: an upload dsec unpacked (under
    DSEC_HOME/build) is given to it in place; any other directory (`dsec image build
    --dockerfile DIR` on the node) is copied into the scratch dir, never chowned."""
    if ctx.resolve().is_relative_to((paths.home / "build").resolve()):
        give_to_buildah(ctx)
        return ctx
    r = subprocess.run(["cp", "-a", "--", str(ctx), str(work / "context")], capture_output=True, text=True)
    if r.returncode != 0:
        raise DsecError(f"copying the build context {ctx} failed: {r.stderr[-2000:]}")
    return work / "context"


def _context_hash(ctx: Path) -> str:
    """sha256 of the context's tree: relative paths, kinds, exec bits, file bytes and link
    targets (not mtimes nor owners: an upload of the same files is the same context)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(ctx):
        dirs.sort()
        for n in sorted(dirs + files):
            p = Path(root) / n
            st = p.lstat()
            h.update(f"{p.relative_to(ctx)}\0{stat.S_IFMT(st.st_mode)}\0{st.st_mode & 0o7777}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
            h.update(b"\0")
    return h.hexdigest()


def build_key(name: str, owner: str | None, ctx: Path, dockerfile: str, text: str,
              build_args: dict[str, str] | None, network: bool, bases: dict[str, ImageInfo]) -> str:
    """What makes two builds the same build: name and owner, Dockerfile, context bytes, build
    args, network and the digests the FROM names resolved to."""
    doc = json.dumps([name, owner, dockerfile, text, sorted((build_args or {}).items()), network,
                      sorted((n, i.digest) for n, i in bases.items()), _context_hash(ctx)])
    return hashlib.sha256(doc.encode()).hexdigest()


def _built_file(paths: Paths, key: str) -> Path:
    return paths.home / "build-results" / f"{key}.json"


def _already_built(svc: ImageService, name: str, key: str) -> ImageBuildResult | None:
    """The result of build `key` if NAME still holds exactly it (the same build is not redone)."""
    f = _built_file(svc.paths, key)
    if not f.is_file():
        return None
    digest = json.loads(f.read_text()).get("digest")
    image = svc.registry.get_image(name)
    if image is None or image.digest != digest:
        return None
    cfg = _config_file(svc.paths, digest)
    return ImageBuildResult(image=image, config=ImageConfig.model_validate_json(cfg.read_text())
                            if cfg.is_file() else ImageConfig())


def build_dockerfile(svc: ImageService, name: str, context: str | os.PathLike, *,
                     dockerfile: str = "Dockerfile", build_args: dict[str, str] | None = None,
                     network: bool = False, replace: bool = False, memory_mb: int = 2048,
                     timeout_s: float = DEFAULT_TIMEOUT_S,
                     progress: Progress | None = None,
                     usable: Callable[[ImageInfo], bool] | None = None,
                     owner: str | None = None) -> ImageBuildResult:
    """Build the Dockerfile in `context` and register the result as dsec image NAME.
    `network`: RUN steps reach the network (default: none, loopback only)."""
    check_name(name)
    ctx = Path(context).absolute()
    df = _check_context(ctx, dockerfile)
    text = df.read_text(encoding="utf-8", errors="replace")
    check_instructions(text)
    bases, stages = find_bases(text)
    infos = resolve_bases(svc, bases, usable)
    for k in (build_args or {}):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", k):
            raise InvalidArgument(f"bad build arg name {k!r}", field="build_args", fix="use ARG names: letters, digits, _")
    existing = svc.registry.get_image(name)
    if existing is not None:
        if not replace:
            raise Conflict(f"image {name!r} already exists", field="name", fix="pass replace=True (--replace)")
        check_may_replace(existing, owner)
    # Identical builds coalesce (issue 24: Harbor trials of one task each build its name): one
    # runs, the others wait on its lock (across processes) and take its image; a name that
    # holds this very build already answers at once. Two builds of one Dockerfile are never
    # byte-identical (mtimes of RUN steps' files), so without this each would replace the name.
    key = build_key(name, owner, ctx, dockerfile, text, build_args, network, infos)
    with FileLock(svc.paths.home / "build-locks" / f"{key[:32]}.lock"):
        done = _already_built(svc, name, key)
        if done is not None:
            report(progress, f"{name} is already built from this context ({done.image.digest[:19]})",
                   1.0, level=logging.INFO)
            return done
        result = _build(svc, name, ctx, df, text, stages, infos, build_args=build_args, network=network,
                        replace=replace, memory_mb=memory_mb, timeout_s=timeout_s, progress=progress,
                        owner=owner)
        f = _built_file(svc.paths, key)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".tmp{os.getpid()}.{threading.get_native_id()}")
        tmp.write_text(json.dumps({"name": name, "digest": result.image.digest}))
        tmp.replace(f)
        return result


def _build(svc: ImageService, name: str, ctx: Path, df: Path, text: str, stages: list[str],
           infos: dict[str, ImageInfo], *, build_args: dict[str, str] | None, network: bool, replace: bool,
           memory_mb: int, timeout_s: float, progress: Progress | None, owner: str | None) -> ImageBuildResult:
    bah = Buildah.for_home(svc.paths)
    t0 = time.monotonic()
    prune_bases(svc, bah)
    tags = {n: ensure_base(svc, bah, info, progress) for n, info in infos.items()}
    target = f"localhost/dsec-build-{os.urandom(6).hex()}:latest"
    with scratch_dir(svc.paths, "dockerfile") as work, build_id_range() as id_base, \
            build_cgroups(f"slot-{(id_base - BUILD_ID_FIRST) // BUILD_ID_RANGE}", memory_mb, BUILD_PIDS) as cgroups:
        rewritten = work / "Dockerfile"
        rewritten.write_text(rewrite_bases(text, tags, stages))
        ctx = _buildah_context(svc.paths, ctx, work)
        give_to_buildah(work)
        idmap = f"0:{id_base}:{BUILD_ID_RANGE}"
        args = ["bud", "--pull=never", "--signature-policy", str(bah.policy),
                "--isolation", "oci", "--runtime", shutil.which("crun") or "crun",
                "--userns-uid-map", idmap, "--userns-gid-map", idmap,
                "--network", "host" if network else "none",
                "--cgroup-manager", "cgroupfs",   # limits: build_cgroups (crun may not set any)
                "--ulimit", "nproc=4096:4096", "--layers=false", "--rm", "--force-rm",
                "--format", "oci", "-f", str(rewritten), "-t", target]
        for k, v in (build_args or {}).items():
            args += ["--build-arg", f"{k}={v}"]
        args.append(str(ctx))
        report(progress, f"buildah bud {name} (RUN steps as host uids {id_base}.., network "
                         f"{'on' if network else 'off'})", None, level=logging.INFO)
        try:
            try:
                bah.run(*args, timeout_s=timeout_s, progress=progress, what="the build",
                        binds=[Bind(ctx), Bind(work, writable=True)], cgroups=cgroups)
            except _BuildahFailed as e:
                raise InvalidArgument(f"building {name} failed (buildah exited {e.rc}); last lines of "
                                      f"the build log:\n{e.tail}", field="dockerfile",
                                      fix="fix the failing step of the Dockerfile (see the log above)") from None
            layout = work / "out"
            bah.run("push", "--signature-policy", str(bah.policy), "--quiet", target,
                    f"oci:{layout}:latest", progress=progress, what="buildah push",
                    binds=[Bind(work, writable=True)])
        finally:
            subprocess.run(bah.argv("rmi", "-f", target), capture_output=True, env=bah.env())
        take_back(layout)
        config = config_from_layout(layout)
        unmap_layout(layout, id_base, BUILD_ID_RANGE)
        image = svc.import_oci(name, oci=layout, ref="latest", replace=replace, progress=progress,
                               source=f"dockerfile:{df}")
        if owner is not None:        # the caller's project owns what it built (tenancy.py)
            image = svc.registry.set_owner(name, owner)
        save_config(svc.paths, image.digest, config)
        safe_rmtree(layout)
    log.info("built %s from %s in %.1fs", name, df, time.monotonic() - t0)
    return ImageBuildResult(image=image, config=config)


def parse_build_args(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise InvalidArgument(f"bad build arg {item!r}", field="build_args", fix="write KEY=VALUE")
        out[k] = v
    return out
