"""Built-in images used by tests and the quickstart.

busybox        Debian's static /bin/busybox plus a symlink per applet, /etc/passwd and
               /etc/group with root and `sandbox` (uid/gid 1000, home /work). No Python.
               Every mtime is the busybox binary's, so the digest only changes with busybox.
debian-python  debootstrap --variant=minbase bookworm + python3, plus the `sandbox` user.
               The debootstrap tree is cached under Paths.home/cache/, so rebuilding after
               `remove` takes seconds and gives the same digest.
fncall-python  debian-python + gcc, g++ and numpy: the FnCall backend's pool image
               (dsec.fncall); cached the same way.
e2b-base       debian-python + pip, venv, git, curl, node and npm: E2B's `base` template (the
               E2B layer's default); cached the same way.
code-interpreter
               e2b-base + Debian's ipykernel and jupyter_client, the data stack (numpy,
               pandas, matplotlib, scipy, scikit-learn, seaborn, ...), R with IRkernel, dsec's
               JavaScript and bash kernels (insandbox/code_interpreter_kernels.py), plus dsec's
               E2B code-interpreter server (insandbox/code_interpreter_server.py) as
               /usr/local/bin/dsec-code-interpreter; cached the same way. Nothing starts by
               itself: `dsec-code-interpreter --daemon` (an exec) serves port 49999.
debian-vm      debootstrap minbase bookworm + systemd-sysv, udev and linux-image-cloud-amd64:
               an image that brings its own kernel (/boot/vmlinuz-*, initrd) and init
               (systemd), for full-VM disks (`dsec vm disk build`, dsec.backends.vm.disks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Callable

from dsec.types import ImageInfo, NotFound, Unavailable

from .builder import scratch_dir
from .progress import Progress, report
from .service import ImageService
from .store import FileLock

log = logging.getLogger("dsec.images")

SANDBOX_UID = SANDBOX_GID = 1000
SANDBOX_HOME = "/work"
BUSYBOX_PATH = Path("/bin/busybox")


def _no_builtin(name: str) -> NotFound:
    return NotFound(f"no built-in image {name!r}", field="name",
                    fix=f"use one of: {', '.join(BUILTIN_IMAGES)}")


def ensure_builtin(service: ImageService, name: str, *,
                   progress: Progress | None = None) -> ImageInfo:
    """Return the built-in image `name`, building and registering it first if needed, and
    building it again (same name, replace) when its recipe changed since it was built: an image
    registered by an older dsec, or under another recipe, is not what this dsec documents."""
    if name not in BUILTIN_IMAGES:
        raise _no_builtin(name)
    fingerprint = recipe_fingerprint(name)
    current = _current(service, name, fingerprint)
    if current is not None:
        return current
    # one builder per node; the others wait and then find it registered
    with FileLock(service.paths.home / "cache" / f".builtin-{name}.lock"):
        current = _current(service, name, fingerprint)
        if current is not None:
            return current
        try:
            service.get(name)
            stale = True
        except NotFound:
            stale = False
        report(progress, f"{'rebuilding' if stale else 'building'} built-in image {name}"
               + (" (its recipe changed)" if stale else ""), None, level=logging.INFO)
        info = BUILTIN_IMAGES[name](service, progress, stale)
        _record_path(service, name).write_text(f"{fingerprint} {info.digest}\n")
        return info


# What a built-in image is made of, beyond its package list: bump when a customization
# (make_busybox_rootfs, add_sandbox_user, install_code_interpreter) changes what it writes.
RECIPE_REVISION = 1
# dsec's own files copied into an image: their content is part of its recipe
RECIPE_FILES: dict[str, tuple[str, ...]] = {
    "code-interpreter": ("code_interpreter_server.py", "code_interpreter_kernels.py",
                         "code_interpreter_node.js"),
}


def recipe_fingerprint(name: str) -> str:
    """A digest of what builds `name`: the recipe revision, its packages, dsec's files in it."""
    from dsec.insandbox import source
    packages = {"debian-python": DEBIAN_PYTHON_PACKAGES, "fncall-python": FNCALL_PYTHON_PACKAGES,
                "e2b-base": E2B_BASE_PACKAGES, "code-interpreter": CODE_INTERPRETER_PACKAGES,
                "fncall-polyglot": FNCALL_POLYGLOT_PACKAGES, "debian-vm": DEBIAN_VM_PACKAGES}.get(name, ())
    h = hashlib.sha256(f"{name}\0{RECIPE_REVISION}\0{','.join(packages)}".encode())
    for f in RECIPE_FILES.get(name, ()):
        h.update(b"\0" + hashlib.sha256(source(f).read_bytes()).digest())
    return h.hexdigest()[:32]


def _record_path(service: ImageService, name: str) -> Path:
    """Beside the home's image registry (not in cache/, which test homes share with the node)."""
    d = service.paths.home / "builtin"
    d.mkdir(exist_ok=True)
    return d / f"{name}.recipe"


def _current(service: ImageService, name: str, fingerprint: str) -> ImageInfo | None:
    """The registered image `name` if it was built from this recipe (the record names both)."""
    try:
        info = service.get(name)
    except NotFound:
        return None
    try:
        recorded = _record_path(service, name).read_text().split()
    except OSError:
        return None
    return info if recorded == [fingerprint, info.digest] else None


# ---------------------------------------------------------------------------------------
# busybox
# ---------------------------------------------------------------------------------------


def _check_static(busybox: Path) -> None:
    if not busybox.is_file():
        raise Unavailable(f"{busybox} is missing: the busybox image copies it",
                          fix="apt-get install -y busybox-static")
    with open(busybox, "rb") as f:
        head = f.read(4096)
    if head[:4] != b"\x7fELF" or b"/ld-linux" in head or b"/ld-musl" in head:
        raise Unavailable(f"{busybox} is not a statically linked busybox; it cannot run in a "
                          "rootfs without a C library", fix="apt-get install -y busybox-static")


def _applets(busybox: Path) -> list[str]:
    """Applet paths relative to /, e.g. 'bin/sh', 'usr/bin/env'."""
    proc = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout.strip():
        return [ln.strip().lstrip("/") for ln in proc.stdout.splitlines()
                if "/" in ln.strip().lstrip("/")]
    proc = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True)
    return [f"bin/{ln.strip()}" for ln in proc.stdout.splitlines() if ln.strip()]


def make_busybox_rootfs(root: Path, busybox: Path = BUSYBOX_PATH) -> None:
    _check_static(busybox)
    root.mkdir(parents=True, exist_ok=True)
    dirs = {"bin": 0o755, "sbin": 0o755, "usr": 0o755, "usr/bin": 0o755, "usr/sbin": 0o755,
            "etc": 0o755, "root": 0o700, "proc": 0o555, "sys": 0o555, "dev": 0o755,
            "tmp": 0o1777, "work": 0o755, "var": 0o755, "var/tmp": 0o1777}
    for d, mode in dirs.items():
        (root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(root / d, mode)
    os.chmod(root, 0o755)
    os.chown(root / "work", SANDBOX_UID, SANDBOX_GID)
    target = root / "bin" / "busybox"
    with open(busybox, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.chmod(target, 0o755)
    for rel in _applets(busybox):
        link = root / rel
        if rel == "bin/busybox" or link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/bin/busybox", link)
    files = {
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n"
                      f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{SANDBOX_HOME}:/bin/sh\n"
                      "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        "etc/group": f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
        "etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    }
    for rel, text in files.items():
        (root / rel).write_text(text)
        os.chmod(root / rel, 0o644)
    # fixed timestamps => the image digest depends only on the busybox binary
    stamp = int(busybox.stat().st_mtime)
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for n in filenames + dirnames:
            os.utime(os.path.join(dirpath, n), (stamp, stamp), follow_symlinks=False)
    os.utime(root, (stamp, stamp))


def _build_busybox(service: ImageService, progress: Progress | None, replace: bool) -> ImageInfo:
    with scratch_dir(service.paths, "busybox") as work:
        root = work / "rootfs"
        make_busybox_rootfs(root)
        return service.build_from_dir("busybox", root, source="builtin:busybox", replace=replace,
                                      progress=progress)


# ---------------------------------------------------------------------------------------
# debian-python
# ---------------------------------------------------------------------------------------


def _append_line(path: Path, first_field: str, line: str) -> bool:
    text = path.read_text() if path.exists() else ""
    if any(ln.split(":", 1)[0] == first_field for ln in text.splitlines()):
        return False
    with open(path, "a") as f:
        if text and not text.endswith("\n"):
            f.write("\n")
        f.write(line + "\n")
    return True


def add_sandbox_user(root: Path, *, shell: str = "/bin/bash") -> None:
    """Add user and group `sandbox` (1000:1000, home /work) to a Debian rootfs if missing,
    keeping the mtimes of what it touches so the image digest stays reproducible."""
    etc = root / "etc"
    touched = [root, etc] + [etc / n for n in ("passwd", "group", "shadow", "gshadow")]
    stamps = {p: p.lstat() for p in touched if p.exists()}
    passwd = (etc / "passwd").read_text() if (etc / "passwd").exists() else ""
    uids = {ln.split(":")[2] for ln in passwd.splitlines() if ln.count(":") >= 6}
    if str(SANDBOX_UID) in uids and not any(ln.startswith("sandbox:") for ln in passwd.splitlines()):
        log.warning("uid %d is taken in %s; not adding user 'sandbox'", SANDBOX_UID, root)
    else:
        _append_line(etc / "passwd", "sandbox",
                     f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{SANDBOX_HOME}:{shell}")
        _append_line(etc / "group", "sandbox", f"sandbox:x:{SANDBOX_GID}:")
        if (etc / "shadow").exists():
            _append_line(etc / "shadow", "sandbox", "sandbox:*:19000:0:99999:7:::")
        if (etc / "gshadow").exists():
            _append_line(etc / "gshadow", "sandbox", "sandbox:!::")
    home = root / SANDBOX_HOME.lstrip("/")
    if not home.exists():
        home.mkdir(mode=0o755)
        os.chmod(home, 0o755)
        os.chown(home, SANDBOX_UID, SANDBOX_GID)
        ref = stamps.get(etc / "passwd") or stamps[root]
        os.utime(home, ns=(ref.st_mtime_ns, ref.st_mtime_ns))
    for p, st in stamps.items():
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


DEBIAN_PYTHON_PACKAGES = ("python3", "procps")


def _build_debian_python(service: ImageService, progress: Progress | None, replace: bool) -> ImageInfo:
    return service.build_debootstrap("debian-python", suite="bookworm", include=DEBIAN_PYTHON_PACKAGES,
                                     replace=replace, customize=add_sandbox_user, progress=progress)


# ---------------------------------------------------------------------------------------
# fncall-python: the FnCall pool image (python, bash, C, C++; numpy preloaded by the zygote)
# ---------------------------------------------------------------------------------------

FNCALL_PYTHON_PACKAGES = ("python3", "python3-numpy", "gcc", "g++", "libc6-dev")


def _build_fncall_python(service: ImageService, progress: Progress | None, replace: bool) -> ImageInfo:
    return service.build_debootstrap("fncall-python", suite="bookworm", include=FNCALL_PYTHON_PACKAGES,
                                     replace=replace, customize=add_sandbox_user, progress=progress)


# ---------------------------------------------------------------------------------------
# e2b-base: what E2B's `base` template holds (the E2B layer's default template, D53)
# ---------------------------------------------------------------------------------------

# python3 with pip and venv, git, curl, node and npm: what agent harnesses expect of E2B's base
# (SWE-agent needs git; many `pip install` or `npm install` their tools).
E2B_BASE_TOOLS = ("python3", "python3-pip", "python3-venv", "git", "curl", "ca-certificates",
                  "nodejs", "npm")
# debootstrap resolves dependencies by the first alternative and never resolves a virtual
# package: these are the providers of the virtual packages in npm's closure (node-has:
# node-function-bind, node-cssesc: node-css-selector-tokenizer, node-types-eslint: eslint, ...),
# the smallest provider each, as scripts/debootstrap-providers.py computes them from apt's cache
NPM_PROVIDERS = ("node-function-bind", "node-css-loader", "node-fancy-log",
                 "node-css-selector-tokenizer", "node-cli-table", "node-ampproject-remapping",
                 "node-tape", "eslint", "node-jest-debbundle", "node-babel7", "node-json-schema",
                 "node-read-pkg", "node-npm-run-path", "node-n3")
E2B_BASE_PACKAGES = E2B_BASE_TOOLS + NPM_PROVIDERS


def _build_e2b_base(service: ImageService, progress: Progress | None, replace: bool) -> ImageInfo:
    return service.build_debootstrap("e2b-base", suite="bookworm", include=E2B_BASE_PACKAGES,
                                     replace=replace, customize=add_sandbox_user, progress=progress)


# ---------------------------------------------------------------------------------------
# code-interpreter: what e2b_code_interpreter talks to on port 49999 (Jupyter kernels)
# ---------------------------------------------------------------------------------------

# e2b-base plus: Debian's ipykernel and jupyter_client (python3-ipykernel pulls ipython3, pyzmq,
# tornado, traitlets, matplotlib-inline, debugpy and with it gdb; debootstrap does not resolve
# virtual packages: python3-cffi-backend provides pyzmq's python3-cffi-backend-api-*,
# libboost-regex1.74.0 gdb's libboost-regex1.74.0-icu72); the data stack of E2B's code
# interpreter as far as Debian has it; R with IRkernel (r-cran-irkernel). JavaScript and bash
# are dsec's own kernels (insandbox/code_interpreter_kernels.py) over the image's node and bash.
CODE_INTERPRETER_PACKAGES = E2B_BASE_PACKAGES + (
    "python3-ipykernel", "python3-jupyter-client", "python3-cffi-backend", "libboost-regex1.74.0",
    "python3-numpy", "python3-pandas", "python3-matplotlib", "python3-scipy", "python3-sklearn",
    "python3-seaborn", "python3-requests", "python3-bs4", "python3-openpyxl", "python3-sympy",
    "python3-xlrd", "python3-tz", "python3-pytest", "r-cran-irkernel")
CODE_INTERPRETER_BIN = "usr/local/bin/dsec-code-interpreter"
CODE_INTERPRETER_LIB = "usr/local/lib/dsec-code-interpreter"
KERNELSPECS = "usr/local/share/jupyter/kernels"
def _own_kernelspec(language: str) -> dict:
    return {"argv": ["/usr/bin/python3", f"/{CODE_INTERPRETER_LIB}/code_interpreter_kernels.py",
                     language, "-f", "{connection_file}"],
            "display_name": {"javascript": "JavaScript (node)", "bash": "Bash"}[language],
            "language": language}


def install_code_interpreter(root: Path) -> None:
    """debian-python's customization plus the server at /usr/local/bin/dsec-code-interpreter,
    dsec's JavaScript and bash kernels and their kernelspecs (r-cran-irkernel brings R's), each
    stamped with the mtime of /usr/local/bin (from the cached tree), so the image digest only
    changes with the packages or dsec's in-sandbox sources."""
    from dsec.insandbox import source
    add_sandbox_user(root)
    stamp = (root / "usr/local/bin").lstat().st_mtime_ns if (root / "usr/local/bin").exists() \
        else (root / "usr").lstat().st_mtime_ns
    files: dict[str, tuple[bytes, int]] = {
        CODE_INTERPRETER_BIN: (source("code_interpreter_server.py").read_bytes(), 0o755),
        f"{CODE_INTERPRETER_LIB}/code_interpreter_kernels.py":
            (source("code_interpreter_kernels.py").read_bytes(), 0o755),
        f"{CODE_INTERPRETER_LIB}/code_interpreter_node.js":
            (source("code_interpreter_node.js").read_bytes(), 0o644),
    }
    for language in ("javascript", "bash"):
        files[f"{KERNELSPECS}/{language}/kernel.json"] = (
            json.dumps(_own_kernelspec(language), indent=1).encode(), 0o644)
    touched: set[Path] = set()
    for rel, (data, mode) in files.items():
        target = root / rel
        for parent in reversed(target.relative_to(root).parents[:-1]):
            d = root / parent
            if not d.exists():
                d.mkdir(mode=0o755)
                os.chmod(d, 0o755)
            touched.add(d)
        target.write_bytes(data)
        os.chown(target, 0, 0)
        os.chmod(target, mode)
        touched.add(target)
    for p in sorted(touched, key=lambda p: len(p.parts), reverse=True):
        os.utime(p, ns=(stamp, stamp), follow_symlinks=False)


def _build_code_interpreter(service: ImageService, progress: Progress | None, replace: bool) -> ImageInfo:
    return service.build_debootstrap("code-interpreter", suite="bookworm", include=CODE_INTERPRETER_PACKAGES,
                                     replace=replace, customize=install_code_interpreter, progress=progress)


# ---------------------------------------------------------------------------------------
# fncall-polyglot: the FnCall pool image for SandboxFusion's other languages (D36)
# ---------------------------------------------------------------------------------------

# Debian's own toolchains, the smallest set that serves SandboxFusion's common languages:
# go + go_test (golang-go), java + junit (default-jdk-headless; junit5 brings JUnit's console
# launcher, as SandboxFusion uses), nodejs + typescript (node-typescript's compiler API),
# rust (rustc), csharp (mono-mcs), php, ruby, lua, pytest; plus fncall-python's python/gcc/g++.
FNCALL_POLYGLOT_PACKAGES = FNCALL_PYTHON_PACKAGES + (
    "python3-pytest", "golang-go", "default-jdk-headless", "junit5", "nodejs", "node-typescript",
    "rustc", "mono-mcs", "php-cli", "ruby", "lua5.4")


def _build_fncall_polyglot(service: ImageService, progress: Progress | None, replace: bool) -> ImageInfo:
    return service.build_debootstrap("fncall-polyglot", suite="bookworm", include=FNCALL_POLYGLOT_PACKAGES,
                                     replace=replace, customize=add_sandbox_user, progress=progress)


# ---------------------------------------------------------------------------------------
# debian-vm: brings its own kernel and init (a bootable full-VM disk, dsec.backends.vm.disks)
# ---------------------------------------------------------------------------------------

# The cloud kernel is Debian's smallest (virtio, no hardware drivers); its postinst builds
# /boot/initrd.img-* with initramfs-tools (virtio_blk is a module, so the initrd is needed).
DEBIAN_VM_PACKAGES = ("systemd-sysv", "udev", "linux-image-cloud-amd64")


def _build_debian_vm(service: ImageService, progress: Progress | None, replace: bool) -> ImageInfo:
    return service.build_debootstrap("debian-vm", suite="bookworm", include=DEBIAN_VM_PACKAGES,
                                     replace=replace, customize=add_sandbox_user, progress=progress)


BUILTIN_IMAGES: dict[str, Callable[[ImageService, Progress | None, bool], ImageInfo]] = {
    "busybox": _build_busybox,
    "debian-python": _build_debian_python,
    "e2b-base": _build_e2b_base,
    "fncall-python": _build_fncall_python,
    "code-interpreter": _build_code_interpreter,
    "fncall-polyglot": _build_fncall_polyglot,
    "debian-vm": _build_debian_vm,
}
