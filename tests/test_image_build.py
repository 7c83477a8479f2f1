"""`dsec image build NAME --dockerfile DIR` and POST /v1/images/build: buildah builds a Dockerfile
whose FROM names dsec images; the result is imported through the OCI import, and a sandbox from
it sees what the Dockerfile made. RUN steps are contained (unprivileged user namespace, no
network, nothing written to the host) and leave no mounts or containers behind."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.types import ContainerArgs, InvalidArgument, NotFound

from conftest import stranger_key

pytestmark = pytest.mark.skipif(shutil.which("buildah") is None,
                                reason="buildah is not installed (apt-get install buildah; scripts/install-extras.sh builds)")

DOCKERFILE = """\
FROM debian-python
ARG FLAVOUR=plain
ENV GREETING="hello from a dockerfile" FLAVOUR=$FLAVOUR
WORKDIR /app
COPY hello.txt /app/hello.txt
COPY pkg/ /app/pkg/
RUN python3 -c "open('/app/built.txt', 'w').write('built by RUN')" && mkdir /data && echo x > /data/x
"""


def _context(tmp_path: Path, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    for rel, text in (files or {}).items():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text(text)
    return ctx


def _buildah_state(home: Path) -> tuple[list[str], list[str]]:
    """Working containers and built (non-base) images left in the home's buildah storage (read
    through buildah in its own namespaces: as host root it would leave root-owned files in
    storage that buildah's unprivileged root could not use)."""
    from dsec.config import Paths
    from dsec.images.dockerfile import Buildah
    bah = Buildah.for_home(Paths(home))
    containers = subprocess.run(bah.argv("containers", "--noheading", "--format", "{{.ContainerName}}"),
                                capture_output=True, text=True, env=bah.env()).stdout.split()
    images = subprocess.run(bah.argv("images", "--noheading", "--format", "{{.Name}}"),
                            capture_output=True, text=True, env=bah.env()).stdout.split()
    return containers, [i for i in images if "dsec-base-" not in i]


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(str(path))]


async def test_dockerfile_build_then_sandbox_sees_files_and_env(server, client, tmp_path):
    ctx = _context(tmp_path, DOCKERFILE, {"hello.txt": "hi from the context\n", "pkg/mod.py": "X = 42\n"})
    # what other tests of the shared server left (an E2B template build requested and never
    # started keeps its dir until it is abandoned): this build must add nothing to it
    before = set((server.home / "build").glob("*"))
    lines: list[str] = []
    res = await client.build_image("df-test", ctx, on_progress=lambda ev: lines.append(ev.message))
    assert res.image.name == "df-test" and res.image.layers
    assert any("STEP 7/7" in ln for ln in lines), lines[-10:]          # buildah's log came as progress
    assert res.config.env["GREETING"] == "hello from a dockerfile" and res.config.env["FLAVOUR"] == "plain"
    assert res.config.workdir == "/app"
    cfg = await client.image_config("df-test")
    assert cfg == res.config
    assert any(i.name == "df-test" for i in await client.images())

    sb = await client.create_container(ContainerArgs(image="df-test", env=cfg.env, workdir=cfg.workdir or "/work"))
    try:
        r = await sb.run('pwd; echo "$GREETING"; cat hello.txt built.txt; echo; '
                         'python3 -c "import sys; sys.path.insert(0, \'pkg\'); import mod; print(mod.X)"; '
                         'cat /data/x; stat -c %u:%g /app/built.txt /data')
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split("\n") == ["/app", "hello from a dockerfile", "hi from the context",
                                        "built by RUN", "42", "x", "0:0", "0:0", ""]
    finally:
        await sb.stop()

    containers, images = _buildah_state(server.home)
    assert containers == [] and images == []
    assert _mounts_under(server.home / "buildah") == [] and _mounts_under(server.home / "build") == []
    assert set((server.home / "build").glob("*")) <= before, set((server.home / "build").glob("*")) - before


async def test_bad_from_names_the_image_and_the_fix(client, tmp_path):
    ctx = _context(tmp_path, "FROM python:3.11-slim\nRUN true\n")
    with pytest.raises(NotFound) as e:
        await client.build_image("df-bad", ctx)
    assert "python:3.11-slim" in str(e.value) and "line 1" in str(e.value)
    assert e.value.field == "dockerfile"
    assert "dsec image pull" in (e.value.fix or "") and "debian-python" in (e.value.fix or "")

    (ctx / "Dockerfile").write_text("ARG BASE=debian-python\nFROM $BASE\n")
    with pytest.raises(InvalidArgument) as e2:
        await client.build_image("df-bad", ctx)
    assert "variable" in str(e2.value) and e2.value.field == "dockerfile"


async def test_failing_run_gives_log_tail_and_run_steps_are_contained(server, client, tmp_path):
    """A RUN step is root only inside its own user namespace (host uids from 2^27), sees no
    network but loopback, and cannot write to the host: not to a host path, not to
    /proc/sysrq-trigger (bind mounts of the context are refused: test_cx_build.py)."""
    marker = Path(f"/var/tmp/dsec-build-escape-{os.getpid()}")
    shutil.rmtree(marker, ignore_errors=True)
    df = f"""\
FROM busybox
RUN sh -c '\\
  echo "UIDMAP $(cat /proc/self/uid_map)"; echo "NETS $(ls /sys/class/net | tr "\\n" " ")"; \\
  mkdir -p {marker} && echo pwned > {marker}/x; \\
  echo b > /proc/sysrq-trigger 2>/dev/null || echo "SYSRQ-DENIED"; \\
  echo "step failing now"; exit 7'
"""
    ctx = _context(tmp_path, df)
    with pytest.raises(InvalidArgument) as e:
        await client.build_image("df-fail", ctx)
    msg = str(e.value)
    assert e.value.field == "dockerfile" and "buildah exited" in msg
    assert "step failing now" in msg and "exit status 7" in msg          # the log's tail
    uid_map = re.search(r"UIDMAP\s+0\s+(\d+)\s+(\d+)", msg)
    assert uid_map and int(uid_map.group(1)) >= 1 << 27 and int(uid_map.group(2)) == 65536, msg
    assert re.search(r"NETS lo\s*$", msg, re.M), msg
    assert "SYSRQ-DENIED" in msg
    assert not marker.exists()                                           # written in the build's root only
    assert not (ctx / "escaped").exists()
    assert not any(i.name == "df-fail" for i in await client.images())
    containers, images = _buildah_state(server.home)
    assert containers == [] and images == []
    assert _mounts_under(server.home / "buildah") == []


async def test_network_refused_through_the_api(server, client, tmp_path):
    """network=true would be the node's own network (buildah runs in a netns of its own now):
    refused to tenants and admins alike, naming the field."""
    from dsec.sdk.client import Client
    ctx = _context(tmp_path, "FROM busybox\nRUN true\n")
    async with Client(server.url, api_key=stranger_key(server, "df")) as c:
        for who in (c, client):
            with pytest.raises(InvalidArgument) as e:
                await who.build_image("df-net", ctx, network=True)
            assert e.value.field == "network" and e.value.fix


def test_cli_dockerfile_build(server, tmp_path):
    ctx = _context(tmp_path, "FROM busybox\nENV A=1\nRUN echo cli > /cli.txt\n")
    env = {**os.environ, "DSEC_HOME": str(server.home)}
    dsec = Path(os.sys.executable).with_name("dsec")
    r = subprocess.run([str(dsec), "image", "build", "df-cli", "--dockerfile", str(ctx)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "df-cli sha256:" in r.stdout
    r = subprocess.run([str(dsec), "image", "build", "df-cli2", "--dockerfile", str(ctx / "nope")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and "Dockerfile" in (r.stdout + r.stderr)


async def test_import_route_takes_an_oci_layout_and_refuses_escaping_tars(server, client, images, tmp_path):
    """POST /v1/images/import: an OCI layout sent as a tar becomes an image sandboxes run; a
    tar whose members would land outside the upload dir is refused (tarfile's data filter)."""
    import io
    import tarfile

    import httpx

    from dsec.images.dockerfile import export_oci
    layout, work = tmp_path / "layout", tmp_path / "work"
    work.mkdir()
    export_oci(images, images.get("busybox"), layout, work)
    lines: list[str] = []
    info = await client.import_image("imp-test", oci=layout, ref="latest", on_progress=lambda ev: lines.append(ev.message))
    assert info.name == "imp-test" and lines
    sb = await client.create_container(ContainerArgs(image="imp-test"))
    try:
        assert (await sb.run("echo imported")).stdout == "imported\n"
    finally:
        await sb.stop()

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"pwned"
        ti = tarfile.TarInfo("../../escaped-by-import")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}) as h:
        r = await h.post("/v1/images/import", params={"name": "imp-bad"}, content=buf.getvalue())
    assert r.status_code == 200
    last = r.text.strip().splitlines()[-1]
    assert '"error"' in last and '"field":"body"' in last, last
    assert not (server.home / "escaped-by-import").exists() and not (server.home / "build" / "escaped-by-import").exists()
    assert not any(i.name == "imp-bad" for i in await client.images())


def test_base_export_works_under_a_home_whose_path_is_no_image_reference(dsec_home, images, tmp_path_factory):
    """buildah names an image pulled from an OCI layout after the layout's path. A home with
    upper case or a trailing "_" in its path (mkdtemp makes those) once failed every build with
    "invalid reference format" (CI, stop 17)."""
    from dsec.images.dockerfile import Buildah, ensure_base
    from dsec.images.service import ImageService
    from dsec.config import Paths

    from conftest import _cleanup_home, side_home
    home = side_home(dsec_home, tmp_path_factory, "Home_Upper_")
    try:
        svc = ImageService(Paths(home))
        bah = Buildah.for_home(svc.paths)
        tag = ensure_base(svc, bah, svc.get("busybox"), None)
        assert bah.has_image(tag)
        names = subprocess.run(bah.argv("images", "--noheading", "--format", "{{.Name}}"), capture_output=True,
                               text=True, env=bah.env()).stdout.split()
        assert names == [tag.rsplit(":", 1)[0]], names    # the layout's path-derived name is gone
    finally:
        _cleanup_home(home)           # the export mounted busybox's layer under this home
    assert _mounts_under(home) == []


async def test_a_compressed_context_may_not_unpack_without_bound(server, tmp_path):
    """Issue 22, item 4: a 305 KB xz context unpacked to 2.18 GiB under DSEC_HOME/build. What an
    upload unpacks to is bounded by its own size (x200 + 256 MiB) and the project's disk policy:
    a 600 MiB file of zeros in a ~600 KB gzip body is refused, naming the body, and nothing is
    left under DSEC_HOME/build."""
    import gzip
    import io
    import json
    import tarfile

    import httpx
    size = 600 << 20
    raw = tmp_path / "bomb.tar.gz"
    with gzip.open(raw, "wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w|") as tf:
        df = b"FROM busybox\nCOPY zeros /zeros\n"
        ti = tarfile.TarInfo("Dockerfile")
        ti.size = len(df)
        tf.addfile(ti, io.BytesIO(df))
        ti = tarfile.TarInfo("zeros")
        ti.size = size

        class Zeros(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b):         # type: ignore[override]
                b[:] = bytes(len(b))
                return len(b)
        tf.addfile(ti, io.BufferedReader(Zeros(), 1 << 20))
    assert raw.stat().st_size < 1 << 20          # under the bound: 256 MiB + 200 x the body
    before = set((server.home / "build").glob("*"))
    async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                 headers={"Authorization": f"Bearer {stranger_key(server, 'bomb')}"}) as h:
        r = await h.post("/v1/images/build", params={"name": "df-bomb"}, content=raw.read_bytes())
    last = json.loads(r.text.strip().splitlines()[-1])
    assert last.get("error"), last
    assert last["error"]["field"] == "body" and "unpacks to more than" in last["error"]["message"], last
    assert set((server.home / "build").glob("*")) <= before


async def test_build_memory_stays_within_the_project_policy(server, client, tmp_path):
    """Issue 22, item 4: a sub-project whose policy says max_memory_mb=1024 ran a RUN step with
    3 GiB (memory_mb up to 65536 was accepted). Asking above the policy is refused naming
    memory_mb; leaving it off gives the RUN steps the policy's limit."""
    from dsec.sdk.client import Client
    p = await client.create_project(f"df-mem-{os.urandom(3).hex()}")
    await client.set_policy(p.id, {"max_memory_mb": 1024})
    key = (await client.create_key(p.id)).key
    ctx = _context(tmp_path, "FROM busybox\nRUN cat /sys/fs/cgroup/memory/memory.limit_in_bytes "
                             "/sys/fs/cgroup/memory.max 2>/dev/null; exit 3\n")
    async with Client(server.url, api_key=key) as c:
        with pytest.raises(InvalidArgument) as e:
            await c.build_image("df-mem", ctx, memory_mb=3072)
        assert e.value.field == "memory_mb" and "1024" in e.value.message
        with pytest.raises(InvalidArgument) as e:
            await c.build_image("df-mem", ctx)                   # the step prints its limit, then fails
        assert str(1024 << 20) in str(e.value), str(e.value)[-800:]


async def test_uploads_in_flight_are_counted_against_the_project(server, client):
    """Issue 22, item 4: uploads were bounded one by one, never together: a tenant could stream
    any number of 16 GiB bodies to DSEC_HOME/build at once. What a project's uploads in flight
    hold (bodies as they arrive, then what they may unpack to) is counted against its
    max_disk_mb: a second upload past it is refused (429 naming the body), and once the first
    is gone its bytes are given back."""
    import socket

    import httpx
    from dsec.sdk.client import Client
    p = await client.create_project(f"df-up-{os.urandom(3).hex()}")
    await client.set_policy(p.id, {"max_disk_mb": 64})
    key = (await client.create_key(p.id)).key
    first = socket.create_connection(("127.0.0.1", server.port))
    held = (63 << 20) + (1 << 19)          # 63.5 MiB of a body that never completes
    first.sendall(f"POST /v1/images/import?name=up-a&format=docker-archive HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {key}\r\nContent-Length: {128 << 20}\r\n\r\n".encode())
    await asyncio.to_thread(first.sendall, bytes(held))
    await asyncio.sleep(1)
    before = set((server.home / "build").glob("*"))
    async with httpx.AsyncClient(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as h:
        r = await h.post("/v1/images/import", params={"name": "up-b", "format": "docker-archive"},
                         content=bytes(1 << 20))
        assert r.status_code == 429, r.text[:300]
        err = r.json()["error"]
        assert err["field"] == "body" and "64 MiB" in err["message"] and "max_disk_mb" in err["fix"], err
        first.close()                      # the first upload goes away: its bytes are given back
        await asyncio.sleep(1)
        r = await h.post("/v1/images/import", params={"name": "up-c", "format": "docker-archive"},
                         content=bytes(1 << 20))
        assert r.status_code != 429, r.text[:300]
    assert set((server.home / "build").glob("*")) <= before
    async with Client(server.url, api_key=key) as c:           # another project is not held up by it
        assert await c.images() is not None


SLOW_DOCKERFILE = """\
FROM debian-python
COPY v.txt /v.txt
RUN sleep 2 && date +%s%N > /built-at
"""


async def test_identical_concurrent_builds_share_one_build(server, client, tmp_path):
    """Issue 24: Harbor trials of a task each build its name with replace=True. Identical
    builds run once: all get one digest (two real builds never match: RUN writes a new
    timestamp), and an identical build later answers at once."""
    ctx = _context(tmp_path, SLOW_DOCKERFILE, {"v.txt": "one\n"})
    results = await asyncio.gather(*(client.build_image("df-same", ctx, replace=True) for _ in range(3)))
    assert len({r.image.digest for r in results}) == 1, [r.image.digest for r in results]
    assert [i.digest for i in await client.images() if i.name == "df-same"] == [results[0].image.digest]
    again = await client.build_image("df-same", ctx, replace=True)
    assert again.image.digest == results[0].image.digest
    (ctx / "v.txt").write_text("two\n")                   # another context: a real rebuild
    other = await client.build_image("df-same", ctx, replace=True)
    assert other.image.digest != results[0].image.digest


async def test_creates_racing_a_replace_of_the_name_all_succeed(server, client, tmp_path):
    """Issue 24: a replace never pulls the image out from under a create that resolved it."""
    ctx = _context(tmp_path, SLOW_DOCKERFILE, {"v.txt": "v0\n"})
    await client.build_image("df-race", ctx)
    failures: list[BaseException] = []

    async def creates(stop: asyncio.Event) -> None:
        while not stop.is_set():
            got = await asyncio.gather(*(client.create_container(ContainerArgs(image="df-race")) for _ in range(3)),
                                       return_exceptions=True)
            for sb in got:
                if isinstance(sb, BaseException):
                    failures.append(sb)
                else:
                    await sb.stop()

    for v in range(1, 3):
        (ctx / "v.txt").write_text(f"v{v}\n")
        stop = asyncio.Event()
        loop = asyncio.create_task(creates(stop))
        await client.build_image("df-race", ctx, replace=True)
        await asyncio.sleep(1.0)
        stop.set()
        await loop
    assert failures == [], failures[:3]
