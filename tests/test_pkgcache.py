"""The node's package cache (issue 25.4) with real pip and npm in sandboxes.

Upstream is a PyPI-like index and an npm-like registry in the egress peer's namespace
(tests/pkgcache_peer.py, tests/egress_peer.py): nothing leaves the machine. The server under
test runs on a bridge of its own with DSEC_PKGCACHE_PYPI_URL / _NPM_URL pointing at that ep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from egress_peer import peer, side_server  # noqa: F401 (fixtures)
from pkgcache_peer import FETCH, PackageUpstream, make_npm_tgz, make_wheel

PIP = ("PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --disable-pip-version-check --no-cache-dir "
       "--target /tmp/t-{pkg} {pkg} && "
       "python3 -c 'import sys; sys.path.insert(0, \"/tmp/t-{pkg}\"); import {pkg}; print({pkg}.VALUE)'")
NPM = ("mkdir -p /tmp/n && cd /tmp/n && npm install --no-audit --no-fund --no-package-lock --loglevel=error {pkg} "
       "&& node -e 'console.log(require(\"{pkg}\"))'")


@pytest.fixture(scope="module")
def upstream(request, tmp_path_factory):
    ep = request.getfixturevalue("peer")
    d = tmp_path_factory.mktemp("pkg-upstream")
    up = PackageUpstream(ep.ns, ep.ip, d / "root")
    wheels = d / "wheels"
    wheels.mkdir()
    up.add_wheel("dsectiny", make_wheel(wheels, "dsectiny", "1.0", "tiny-from-upstream"))
    good = make_wheel(wheels, "dsecpoison", "1.0", "good")
    up.add_wheel("dsecpoison", good, served=make_wheel(d, "dsecpoison", "1.0", "EVIL").read_bytes())
    up.add_npm("dsectinynpm", "1.0.0", make_npm_tgz(wheels, "dsectinynpm", "1.0.0", "npm-from-upstream"))
    ep.set_zone({"allowed.test": ep.ip, "pypi.test": ep.ip})
    up.start()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def cserver(images, dsec_home, tmp_path_factory, request, upstream):
    ep = request.getfixturevalue("peer")
    from dsec.images.builtin import ensure_builtin
    ensure_builtin(images, "e2b-base")   # before the side home copies the image records
    with side_server(dsec_home, tmp_path_factory, "pkgcache", ep,
                     DSEC_PKGCACHE_PYPI_URL=f"http://pypi.test:{upstream.port}/simple/",
                     DSEC_PKGCACHE_NPM_URL=f"http://pypi.test:{upstream.port}/npm/") as srv:
        yield srv


async def fetch(sb, checks: list[list[str]]) -> dict:
    await sb.files.write("/tmp/fetch.py", FETCH)
    r = await sb.run(f"python3 /tmp/fetch.py '{json.dumps(checks)}'", timeout_s=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


async def run_ok(sb, cmd: str) -> str:
    r = await sb.run(cmd, timeout_s=300)
    assert r.exit_code == 0, (cmd, r.stdout[-2000:], r.stderr[-3000:])
    return r.stdout.strip().splitlines()[-1]


def file_requests(upstream: PackageUpstream, name: str) -> int:
    return sum(1 for line in upstream.requests() if line.split(" ")[0].endswith("/" + name))


async def test_pip_and_npm_install_through_the_cache_once_per_node_then_with_upstream_down(cserver, upstream):
    wheel = "dsectiny-1.0-py3-none-any.whl"
    async with cserver.client() as c:
        by_name = await c.create_container(image="e2b-base", network={"domains": ["pypi.test"]})
        by_cidr = await c.create_container(image="e2b-base", network={"rules": [{"cidr": upstream.ip}]})
        try:
            env = await run_ok(by_name, "echo $PIP_INDEX_URL $npm_config_registry")
            assert env.startswith("http://10.197.") and ":10081/pypi/simple/ http://" in env, env
            assert await run_ok(by_name, PIP.format(pkg="dsectiny")) == "tiny-from-upstream"
            # another sandbox (another policy form): the same wheel, not fetched again
            assert await run_ok(by_cidr, PIP.format(pkg="dsectiny")) == "tiny-from-upstream"
            assert file_requests(upstream, wheel) == 1, upstream.requests()
            assert await run_ok(by_cidr, NPM.format(pkg="dsectinynpm")) == "npm-from-upstream"
            upstream.stop()
            try:   # upstream down: pages and files come from the cache
                assert await run_ok(by_name, "rm -rf /tmp/t-dsectiny && " + PIP.format(pkg="dsectiny")) == \
                    "tiny-from-upstream"
                assert await run_ok(by_name, NPM.format(pkg="dsectinynpm")) == "npm-from-upstream"
            finally:
                upstream.start()
            assert file_requests(upstream, wheel) == 1
            assert file_requests(upstream, "dsectinynpm-1.0.0.tgz") == 1
        finally:
            await by_name.stop()
            await by_cidr.stop()


async def test_a_poisoned_file_is_refused_and_policies_bound_who_uses_the_cache(cserver, upstream):
    async with cserver.client() as c:
        sb = await c.create_container(image="e2b-base", network={"domains": ["pypi.test"]})
        other = await c.create_container(image="e2b-base", network={"domains": ["allowed.test"]})
        tunnelled = await c.create_container(image="e2b-base", network={"rules": [{"cidr": upstream.ip}],
                                                                        "egress_proxy": {"address": f"{upstream.ip}:1080"}})
        none = await c.create_container(image="e2b-base")
        try:
            r = await sb.run(PIP.format(pkg="dsecpoison"), timeout_s=300)
            assert r.exit_code != 0 and "EVIL" not in r.stdout, (r.stdout, r.stderr)
            base = (await run_ok(sb, "echo $PIP_INDEX_URL")).rsplit("/pypi/", 1)[0]
            page = (await fetch(sb, [["p", "GET", f"{base}/pypi/simple/dsecpoison/"]]))["p"]
            href = page[1].split('href="', 1)[1].split("#", 1)[0]
            got = await fetch(sb, [["f", "GET", href], ["again", "GET", href]])
            assert got["f"][0] == 502 and "do not match" in got["f"][1], got
            assert got["again"][0] == 502, got          # never stored: asked again, refused again
            assert file_requests(upstream, "dsecpoison-1.0-py3-none-any.whl") >= 2
            # a policy that does not reach the upstream: refused by name, the fix named
            got = await fetch(other, [["p", "GET", f"{base}/pypi/simple/dsectiny/"]])
            assert got["p"][0] == 403 and "pypi.test" in got["p"][1] and "domains" in got["p"][1], got
            # a tunnelled sandbox's TCP leaves only through its SOCKS server; no egress: no cache
            for s in (tunnelled, none):
                got = await fetch(s, [["p", "GET", f"{base}/pypi/simple/dsectiny/"]])
                assert got["p"][0] == 0, got
                # and pip is not pointed at a cache it cannot reach
                assert (await s.run("echo ${PIP_INDEX_URL:-unset}")).stdout.strip() == "unset"
        finally:
            for s in (sb, other, tunnelled, none):
                await s.stop()


async def test_seeded_files_serve_a_node_without_upstream(cserver, upstream, tmp_path):
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    make_wheel(seeds, "dsecseeded", "2.0", "from-the-seed")
    make_npm_tgz(seeds, "dsecseednpm", "0.1.0", "npm-from-the-seed")
    (seeds / "notes.txt").write_text("skipped")
    r = subprocess.run([sys.executable, "-m", "dsec", "cache", "seed", str(seeds)], capture_output=True, text=True,
                       env={**os.environ, "DSEC_HOME": str(cserver.home)}, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pypi"] == ["dsecseeded-2.0-py3-none-any.whl"] and out["npm"] == ["dsecseednpm@0.1.0"], out
    assert "notes.txt" in out["skipped"][0]
    upstream.stop()
    try:
        async with cserver.client() as c:
            sb = await c.create_container(image="e2b-base", network={"domains": ["pypi.test"]})
            try:
                assert await run_ok(sb, PIP.format(pkg="dsecseeded")) == "from-the-seed"
                assert await run_ok(sb, NPM.format(pkg="dsecseednpm")) == "npm-from-the-seed"
            finally:
                await sb.stop()
    finally:
        upstream.start()
    assert not any("dsecseed" in line for line in upstream.requests())


@pytest.mark.skipif(not os.environ.get("DSEC_BENCH"), reason="benchmark: DSEC_BENCH=1 pytest -s -k bench")
async def test_bench_n_sandboxes_pip_install_the_same_wheels(cserver, upstream, tmp_path):
    """N sandboxes install the same 5 wheels (4 MiB each, random bytes) at once from an upstream
    throttled to 25 MB/s: directly (PIP_INDEX_URL at upstream), then through the cache (cold),
    then again (warm). Wall time and upstream file requests per round (docs/benchmarks.md)."""
    import asyncio
    import time
    n = int(os.environ.get("DSEC_BENCH_N", "8"))
    pkgs = [f"dsecbench{i}" for i in range(5)]
    for p in pkgs:
        upstream.add_wheel(p, make_wheel(tmp_path, p, "1.0", p, pad=4 << 20))
    upstream.set_rate(25_000_000)
    install = ("PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --disable-pip-version-check --no-cache-dir "
               "--target /tmp/b-{r} " + " ".join(pkgs))
    direct = {"PIP_INDEX_URL": f"http://pypi.test:{upstream.port}/simple/",
              "PIP_TRUSTED_HOST": f"pypi.test:{upstream.port}"}
    rows = []
    try:
        async with cserver.client() as c:
            sbs = await asyncio.gather(*[c.create_container(image="e2b-base", memory_mb=512,
                                                            network={"rules": [{"cidr": upstream.ip}]}) for _ in range(n)])
            try:
                for r, env in (("direct", direct), ("cache-cold", {}), ("cache-warm", {})):
                    before = sum(file_requests(upstream, f"{p}-1.0-py3-none-any.whl") for p in pkgs)
                    t0 = time.monotonic()
                    res = await asyncio.gather(*[sb.run(install.format(r=r), env=env, timeout_s=600) for sb in sbs])
                    wall = time.monotonic() - t0
                    assert all(x.exit_code == 0 for x in res), [x.stderr[-500:] for x in res if x.exit_code]
                    fetched = sum(file_requests(upstream, f"{p}-1.0-py3-none-any.whl") for p in pkgs) - before
                    rows.append((r, round(wall, 1), fetched))
            finally:
                await asyncio.gather(*[sb.stop() for sb in sbs])
    finally:
        upstream.set_rate(0)
    print(f"\nBENCH pkgcache n={n} (round, wall s, upstream wheel downloads): {rows}")
