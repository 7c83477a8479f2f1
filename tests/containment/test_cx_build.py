"""Attacks through Dockerfile builds (issue 22, item 2): a tenant's Dockerfile tries to reach
the host through buildah 1.28 (Debian 12), which runs as host root.

Two layers of defence, each tested: the Dockerfile is refused before buildah runs when it asks
for what reaches outside the build (RUN --mount other than tmpfs, ADD of a URL), naming the
line; and buildah itself runs as root of a user namespace of unprivileged host ids, in new
mount, network, pid, IPC and UTS namespaces whose root holds only the system's programs, its
storage and the build (images/build_jail.py)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import stranger_key

from dsec.images.build_jail import Bind, jailed, userns_helper
from dsec.images.dockerfile import BUILD_ID_FIRST, BUILDAH_IDS, BUILDAH_ROOT_ID
from dsec.sdk.client import Client
from dsec.types import InvalidArgument

pytestmark = pytest.mark.skipif(shutil.which("buildah") is None,
                                reason="buildah is not installed (apt-get install buildah; scripts/install-extras.sh builds)")


def _context(tmp_path: Path, dockerfile: str) -> Path:
    ctx = tmp_path / f"ctx-{secrets.token_hex(3)}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    (ctx / "local.txt").write_text("local\n")
    return ctx


@pytest.fixture(scope="module")
async def tenant(server):
    async with Client(server.url, api_key=stranger_key(server, "cx-build")) as c:
        yield c


@pytest.mark.parametrize("line,why", [
    # the reported escape: a stage's symlink to / as the source of a read-write bind mount
    ("RUN --mount=type=bind,from=s,source=/rootlink,target=/host,rw touch /host/var/tmp/{name}", "RUN --mount"),
    ("RUN --mount=type=cache,target=/var/cache/x,source=../../../ ls", "RUN --mount"),
    ("RUN --mount=type=bind,target=/ctx,rw touch /ctx/escaped", "RUN --mount"),
    ("RUN --network=host true", "RUN --network"),
    ("ADD http://127.0.0.1:7620/healthz /healthz", "ADD http://"),
    ('ADD ["https://127.0.0.1/x", "/x"]', "ADD https://"),
])
async def test_dockerfile_steps_that_reach_outside_are_refused_naming_the_line(tenant, tmp_path, line, why):
    name = f"dsec-cx-build-{secrets.token_hex(4)}"
    df = f"FROM busybox AS s\nRUN ln -s / /rootlink\nFROM busybox\n{line.format(name=name)}\n"
    with pytest.raises(InvalidArgument) as e:
        await tenant.build_image("cx-df", _context(tmp_path, df))
    assert e.value.field == "dockerfile" and "line 4" in e.value.message and why in e.value.message, e.value
    assert e.value.fix
    assert not Path("/var/tmp", name).exists()


async def test_continuation_lines_and_onbuild_do_not_hide_a_mount(tenant, tmp_path):
    df = "FROM busybox\nRUN \\\n  --mount=type=bind,target=/ctx,rw \\\n  true\nONBUILD RUN --mount=type=cache,target=/c true\n"
    with pytest.raises(InvalidArgument) as e:
        await tenant.build_image("cx-df", _context(tmp_path, df))
    assert "line 2" in e.value.message


def test_buildah_sees_only_its_storage_and_the_build(server, tmp_path, host_canary):
    """What any buildah command sees: no DSEC_HOME keys or databases, no /var/tmp, no other
    checkouts, no host network (only its own lo), a pid namespace of its own, the context
    read-only and the scratch dir read-write."""
    ctx, work = tmp_path / "ctx", tmp_path / "work"
    ctx.mkdir()
    work.mkdir()
    (ctx / "in-context.txt").write_text("ctx\n")
    probe = "; ".join([
        f"test -e {server.paths.admin_key_file} && echo KEY-VISIBLE",
        f"test -e {server.paths.home}/iam.db && echo DB-VISIBLE",
        f"test -e {host_canary} && echo CANARY-VISIBLE",
        f"test -e {Path.cwd()}/README.md && echo CHECKOUT-VISIBLE",
        "test -S /run/postgresql/.s.PGSQL.5432 && echo PG-VISIBLE",
        "echo NETS $(ls /sys/class/net | tr '\\n' ' ')",
        "echo PIDS $(ls /proc | grep -c '^[0-9]')",
        "echo HOST $(hostname)",
        f"cat {ctx}/in-context.txt",
        f"touch {ctx}/written 2>/dev/null || echo CTX-READONLY",
        f"echo w > {work}/written && echo WORK-WRITABLE",
        "touch /usr/bin/planted 2>/dev/null || echo USR-READONLY",
    ])
    os.chown(work, BUILDAH_ROOT_ID, BUILDAH_ROOT_ID)              # dockerfile.give_to_buildah
    argv = jailed(["/bin/sh", "-c", probe], root=tmp_path / "jail", binds=[Bind(ctx), Bind(work, writable=True)],
                  cwd=work, ids=BUILDAH_IDS, helper=userns_helper(server.paths.bin))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for leak in ("KEY-VISIBLE", "DB-VISIBLE", "CANARY-VISIBLE", "CHECKOUT-VISIBLE", "PG-VISIBLE"):
        assert leak not in out, out
    assert "NETS lo \n" in out or out.count("NETS lo") == 1, out
    pids = int(out.split("PIDS ")[1].split()[0])
    assert pids <= 4, out                                     # sh, ls, grep: its own pid namespace
    assert "HOST dsec-build" in out and "ctx\n" in out
    assert "CTX-READONLY" in out and "WORK-WRITABLE" in out and "USR-READONLY" in out
    assert not (ctx / "written").exists() and (work / "written").read_text() == "w\n"
    assert not Path("/usr/bin/planted").exists()
    with open("/proc/self/mountinfo") as f:                   # nothing of the jail on the host
        assert not [ln for ln in f if str(tmp_path / "jail") in ln]
    os.rmdir(tmp_path / "jail")


def _status(pid: int, key: str) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        return [int(x) for x in next(ln for ln in f if ln.startswith(key + ":")).split()[1:]]


def _under(pid: int, ancestors: set[int]) -> bool:
    while pid > 1:
        if pid in ancestors:
            return True
        pid = _status(pid, "PPid")[0]
    return False


async def test_buildah_is_root_of_a_user_namespace_not_of_the_host(tenant, tmp_path):
    """Issue 22, item 2: a buildah bug must not give the tenant host root. While a build runs
    (a slow RUN step), every buildah process on the host has unprivileged host uids (its
    namespace's root is BUILDAH_ROOT_ID), sits in a user namespace other than the host's, and
    that namespace maps neither host root nor any id below the build ranges; the RUN step, one
    level down, is root of its own slot's range."""
    df = "FROM busybox\nRUN cat /proc/self/uid_map; sleep 6\n"
    build = asyncio.create_task(tenant.build_image(f"cx-userns-{secrets.token_hex(3)}", _context(tmp_path, df)))
    host_ns = os.readlink("/proc/self/ns/user")
    seen: dict[int, tuple[list[int], str, str]] = {}
    sleeps: dict[int, list[int]] = {}
    deadline = time.monotonic() + 120
    while not build.done() and time.monotonic() < deadline:
        pids = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]
        for pid in pids:
            try:
                if os.readlink(f"/proc/{pid}/exe").endswith("/buildah"):
                    seen[pid] = (_status(pid, "Uid"), os.readlink(f"/proc/{pid}/ns/user"),
                                 Path(f"/proc/{pid}/uid_map").read_text())
            except (OSError, StopIteration):
                continue
        for pid in pids:               # the RUN step's sleep (not a sandbox's): below a buildah
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x006\x00" and _under(pid, set(seen)):
                    sleeps[pid] = _status(pid, "Uid")
            except (OSError, StopIteration):
                continue
        await asyncio.sleep(0.2)
    await build
    assert seen, "no buildah process was seen while the build ran"
    for pid, (uids, ns, uid_map) in seen.items():
        assert uids == [BUILDAH_ROOT_ID] * 4, (pid, uids)           # real, effective, saved, fs
        assert ns != host_ns, pid
        outside = [(int(a), int(b), int(c)) for a, b, c in (ln.split() for ln in uid_map.splitlines())]
        assert all(o >= BUILD_ID_FIRST for _, o, _ in outside), uid_map     # no host root, no host user
        assert (0, BUILDAH_ROOT_ID, 65536) in outside, uid_map
    assert sleeps, "the RUN step's sleep was not seen"
    for pid, uids in sleeps.items():                                 # RUN steps: their slot's root
        assert all(BUILD_ID_FIRST <= u < BUILDAH_ROOT_ID for u in uids), (pid, uids)


def test_a_link_in_the_layout_buildah_wrote_is_refused_before_host_root_reads_it(tmp_path):
    """buildah writes the built image's layout as its unprivileged root; host root then reads
    and rewrites it (unmap_layout). A subverted buildah could leave a link to a host file there
    (index.json -> /var/lib/dsec/admin.key, a blob -> /etc/shadow): refused, never followed."""
    from dsec.images.dockerfile import take_back
    from dsec.types import DsecError
    layout = tmp_path / "out"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "index.json").write_text("{}")
    os.chown(layout / "index.json", BUILDAH_ROOT_ID, BUILDAH_ROOT_ID)
    take_back(layout)
    assert (layout / "index.json").stat().st_uid == 0
    (layout / "blobs" / "sha256" / "ab").symlink_to("/etc/hostname")
    with pytest.raises(DsecError, match="neither a file nor a directory"):
        take_back(layout)
    (layout / "blobs" / "sha256" / "ab").unlink()
    os.mkfifo(layout / "fifo")
    with pytest.raises(DsecError):
        take_back(layout)
    moved = tmp_path / "real"
    (layout / "fifo").unlink()
    layout.rename(moved)
    layout.symlink_to(moved)
    with pytest.raises(DsecError):
        take_back(layout)
