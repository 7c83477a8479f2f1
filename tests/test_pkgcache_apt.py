"""apt through the node's package cache (issue 25.4) with the real apt of debian-python.

A signed Debian repository (tests/apt_peer.py) is served from the egress peer's namespace as
http://apt.test:8082/<mirror>/ (nothing leaves the box); the server under test is a side
server of its own (tests/egress_peer.py). Sandboxes trust the repository's throw-away key by
[signed-by=]; dsec binds /etc/apt/apt.conf.d/90dsec-pkgcache, making the cache apt's proxy.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from apt_peer import AptRepo, make_deb
from conftest import stranger_key
from egress_peer import peer, side_server  # noqa: F401 (fixtures)
from pkgcache_peer import PackageUpstream

PORT = 8082
APT = ("rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && mkdir -p /etc/apt/keyrings && "
       "cp /tmp/{key}.gpg /etc/apt/keyrings/ && chmod 644 /etc/apt/keyrings/{key}.gpg && "
       "echo 'deb [signed-by=/etc/apt/keyrings/{key}.gpg] http://apt.test:" + str(PORT) + "/{mirror} stable main' "
       "> /etc/apt/sources.list.d/t.list && apt-get update -q && "
       "apt-get install -y -q --no-install-recommends --reinstall {pkg} && cat /usr/share/{pkg}/value")
# run in a sandbox: argv[1] is a JSON list of [name, url]; each GET through the cache as apt asks
# it (proxy-style); prints {name: [status, sha256 of the body]}
VIA_PROXY = r'''
import hashlib, json, re, sys, urllib.error, urllib.request
proxy = re.search(r'Proxy "(http://[^"]+)"', open("/etc/apt/apt.conf.d/90dsec-pkgcache").read()).group(1)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
out = {}
for name, url in json.loads(sys.argv[1]):
    try:
        r = opener.open(url, timeout=60)
        out[name] = [r.status, hashlib.sha256(r.read()).hexdigest()]
    except urllib.error.HTTPError as e:
        out[name] = [e.code, e.read().decode("utf-8", "replace")[:300]]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def mirrors(request, tmp_path_factory):
    """/debian (the good key): dsechello "good", dsectamper listed good but served tampered;
    /evil (another key, one project's own mirror): dsechello "EVIL" at the same pool path."""
    ep = request.getfixturevalue("peer")
    d = tmp_path_factory.mktemp("apt-upstream")
    up = PackageUpstream(ep.ns, ep.ip, d / "root", port=PORT)
    debs = d / "debs"
    debs.mkdir()
    good = AptRepo(up.root / "debian", d / "gpg-good")
    hello = make_deb(debs, "dsechello", "1.0", "good")
    good.add(hello)
    (debs / "evil").mkdir()
    evil_hello = make_deb(debs / "evil", "dsechello", "1.0", "EVIL")
    good.add(make_deb(debs, "dsectamper", "1.0", "good"),
             served=make_deb(debs / "evil", "dsectamper", "1.0", "EVIL").read_bytes())
    good.publish()
    evil = AptRepo(up.root / "evil", d / "gpg-evil")
    evil.add(evil_hello)
    evil.publish()
    ep.set_zone({"apt.test": ep.ip})
    up.start()
    yield up, good, evil, hello, evil_hello
    up.stop()
    good.close()
    evil.close()


@pytest.fixture(scope="module")
def aserver(images, dsec_home, tmp_path_factory, request, mirrors):
    ep = request.getfixturevalue("peer")
    with side_server(dsec_home, tmp_path_factory, "pkgcache-apt", ep) as srv:
        yield srv


async def sandbox(client, mirrors, **kw):
    _, good, evil, _, _ = mirrors
    sb = await client.create_container(image="debian-python", network={"domains": ["apt.test"]}, **kw)
    await sb.files.write("/tmp/good.gpg", good.keyring())
    await sb.files.write("/tmp/evil.gpg", evil.keyring())
    await sb.files.write("/tmp/via_proxy.py", VIA_PROXY)
    return sb


async def run(sb, cmd: str):
    return await sb.run(cmd, user="root", timeout_s=300)


async def via_proxy(sb, checks: list[list[str]]) -> dict:
    r = await run(sb, f"python3 /tmp/via_proxy.py '{json.dumps(checks)}'")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def requests_for(up: PackageUpstream, suffix: str) -> int:
    return sum(1 for line in up.requests() if line.split(" ")[0].endswith(suffix))


async def test_two_projects_install_the_same_deb_fetched_once_and_one_cannot_poison_the_other(aserver, mirrors):
    up, good, evil, hello, evil_hello = mirrors
    pool = "/pool/main/d/dsechello/dsechello_1.0_all.deb"
    from dsec.sdk.client import Client
    async with aserver.client() as ca, Client(aserver.url, stranger_key(aserver, "apt-b")) as cb:
        a = await sandbox(ca, mirrors)
        b = await sandbox(cb, mirrors)
        try:
            conf = (await run(a, "cat /etc/apt/apt.conf.d/90dsec-pkgcache")).stdout
            assert 'Acquire::http::Proxy "http://10.197.' in conf and ':10081/"' in conf, conf
            # project A uses a mirror of its own (its own key) naming dsechello's pool path with
            # other bytes: A gets what it asked for ...
            r = await run(a, APT.format(key="evil", mirror="evil", pkg="dsechello"))
            assert r.exit_code == 0 and r.stdout.strip().endswith("EVIL"), (r.stdout[-2000:], r.stderr[-2000:])
            # ... and tries to make the cache speak for the good mirror with it: the evil
            # Packages' digest asked under the good mirror's by-hash (held: no upstream needed),
            # then the good mirror's pool path
            evil_pk = hashlib.sha256((up.root / "evil/dists/stable/main/binary-amd64/Packages").read_bytes()).hexdigest()
            base = "http://apt.test:%d/debian" % PORT
            got = await via_proxy(a, [["byhash", f"{base}/dists/stable/main/binary-amd64/by-hash/SHA256/{evil_pk}"],
                                      ["deb", base + pool], ["escape", f"{base}/../evil{pool}"]])
            assert got["deb"][0] == 404 and got["escape"][0] == 404, got
            # project B installs from the good mirror: the good bytes
            r = await run(b, APT.format(key="good", mirror="debian", pkg="dsechello"))
            assert r.exit_code == 0 and r.stdout.strip().endswith("good"), (r.stdout[-2000:], r.stderr[-2000:])
            # A installs from the good mirror too: served from the cache, not fetched again
            r = await run(a, APT.format(key="good", mirror="debian", pkg="dsechello"))
            assert r.exit_code == 0 and r.stdout.strip().endswith("good"), (r.stdout[-2000:], r.stderr[-2000:])
            assert requests_for(up, "/debian" + pool) == 1, up.requests()
            # what the cache holds under that pool path is the good .deb, whoever asks
            got = await via_proxy(b, [["deb", base + pool]])
            assert got["deb"] == [200, hashlib.sha256(hello.read_bytes()).hexdigest()], got
            # a tampered upstream file (listed with the good SHA256): refused, never stored
            r = await run(b, APT.format(key="good", mirror="debian", pkg="dsectamper"))
            assert r.exit_code != 0 and "EVIL" not in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
            got = await via_proxy(b, [["deb", base + "/pool/main/d/dsectamper/dsectamper_1.0_all.deb"]])
            assert got["deb"][0] == 502 and "do not match" in got["deb"][1], got
            assert requests_for(up, "dsectamper_1.0_all.deb") >= 2
        finally:
            await a.stop()
            await b.stop()


async def test_a_sandbox_without_egress_gets_no_apt_config_and_others_are_refused(aserver, mirrors):
    async with aserver.client() as c:
        none = await c.create_container(image="debian-python")
        other = await c.create_container(image="debian-python", network={"domains": ["elsewhere.test"]})
        https = await sandbox(c, mirrors)
        try:
            # an https:// mirror is not sent to the cache (apt would CONNECT: 405); it goes direct,
            # here to the peer's HTTPS echo server, whose answer is not a signed InRelease
            r = await run(https, "rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && echo 'deb "
                                 "[signed-by=/tmp/good.gpg] https://apt.test/debian stable main' > "
                                 "/etc/apt/sources.list.d/t.list && apt-get update -o Acquire::https::Verify-Peer=false "
                                 "-o Acquire::https::Verify-Host=false 2>&1")
            out = r.stdout + r.stderr
            assert "apt.test" in out and not any(s in out for s in ("405", "Method Not Allowed", "10081", "DIRECT")), out
            r = await run(none, "ls /etc/apt/apt.conf.d/")
            assert "dsec" not in r.stdout, r.stdout
            await other.files.write("/tmp/via_proxy.py", VIA_PROXY)
            got = await via_proxy(other, [["rel", f"http://apt.test:{PORT}/debian/dists/stable/InRelease"]])
            assert got["rel"][0] == 403 and "apt.test" in got["rel"][1], got
        finally:
            for s in (none, other, https):
                await s.stop()


async def test_a_seeded_mirror_copy_serves_apt_with_no_upstream(aserver, mirrors, tmp_path):
    up, good, *_ = mirrors
    copy = AptRepo(tmp_path / "mirror", tmp_path / "gpg")   # its own key: the sandbox trusts it below
    copy.add(make_deb(tmp_path, "dsecseeded", "2.0", "from-the-seed"))
    copy.publish()
    (tmp_path / "mirror" / "notes.txt").write_text("skipped")
    r = subprocess.run([sys.executable, "-m", "dsec", "cache", "seed", str(tmp_path / "mirror"),
                        "--apt-mirror", f"http://apt.test:{PORT}/seeded"], capture_output=True, text=True,
                       env={**os.environ, "DSEC_HOME": str(aserver.home)}, timeout=120)
    key = copy.keyring()
    copy.close()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "dists/stable/InRelease" in out["apt"] and "pool/main/d/dsecseeded/dsecseeded_2.0_all.deb" in out["apt"], out
    up.stop()
    try:
        async with aserver.client() as c:
            sb = await sandbox(c, mirrors)
            try:
                await sb.files.write("/tmp/seed.gpg", key)
                r = await run(sb, APT.format(key="seed", mirror="seeded", pkg="dsecseeded"))
                assert r.exit_code == 0 and r.stdout.strip().endswith("from-the-seed"), (r.stdout[-2000:],
                                                                                         r.stderr[-2000:])
            finally:
                await sb.stop()
    finally:
        up.start()
    assert not any("/seeded/" in line for line in up.requests())
