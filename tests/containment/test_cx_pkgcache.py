"""Attacks on the node's package cache (issue 25.4): a sandbox cannot write into it, cannot make
it fetch what no index answer named, cannot walk out of its file names, and never sees the
credentials of the (private) index the cache asks."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest

from egress_peer import peer, side_server  # noqa: F401 (fixtures)
from pkgcache_peer import FETCH, PackageUpstream, make_wheel

SECRET = "s3cr3t-idx-pw"


@pytest.fixture(scope="module")
def private(request, tmp_path_factory):
    ep = request.getfixturevalue("peer")
    d = tmp_path_factory.mktemp("cx-pkg")
    up = PackageUpstream(ep.ns, ep.ip, d / "root", port=8081, auth=f"dsecuser:{SECRET}")
    wheel = make_wheel(d, "dsecprivate", "1.0", "private")
    digest = up.add_wheel("dsecprivate", wheel)
    ep.set_zone({"pypi.test": ep.ip})
    up.start()
    yield up, wheel, digest
    up.stop()


@pytest.fixture(scope="module")
def cxserver(images, dsec_home, tmp_path_factory, request, private):
    ep = request.getfixturevalue("peer")
    with side_server(dsec_home, tmp_path_factory, "cx-pkgcache", ep,
                     DSEC_PKGCACHE_PYPI_URL=f"http://dsecuser:{SECRET}@pypi.test:8081/simple/") as srv:
        yield srv


async def test_sandbox_cannot_write_redirect_or_read_the_private_index_credentials(cxserver, private):
    up, wheel, digest = private
    async with cxserver.client() as c:
        sb = await c.create_container(image="debian-python", network={"domains": ["pypi.test"]})
        try:
            base = (await sb.run("echo $PIP_INDEX_URL")).stdout.strip().rsplit("/pypi/", 1)[0]
            page_url = f"{base}/pypi/simple/dsecprivate/"
            file_url = f"{base}/pypi/files/sha256/{digest}/{wheel.name}"
            unknown = hashlib.sha256(b"never listed").hexdigest()
            await sb.files.write("/tmp/fetch.py", FETCH)
            checks = [["page", "GET", page_url], ["file", "GET", file_url],
                      ["put", "PUT", file_url], ["post", "POST", f"{base}/pypi/simple/dsecprivate/"],
                      ["delete", "DELETE", file_url],
                      ["unknown", "GET", f"{base}/pypi/files/sha256/{unknown}/x.whl"],
                      ["traverse", "GET", f"{base}/pypi/files/sha256/{digest}/..%2F..%2F..%2Fpkgcache.db"],
                      ["traverse2", "GET", f"{base}/pypi/files/sha256/..%2F..%2Fpkgcache.db/x"],
                      ["npm_traverse", "GET", f"{base}/npm/..%2F..%2Fetc%2Fpasswd"]]
            r = await sb.run(f"python3 /tmp/fetch.py '{json.dumps(checks)}'", timeout_s=120)
            got = json.loads(r.stdout)
            assert got["page"][0] == 200 and wheel.name in got["page"][1], got
            assert got["file"][0] == 200, got   # the private index's file, fetched with its credentials
            assert all(got[k][0] == 405 for k in ("put", "post", "delete")), got
            assert all(got[k][0] == 404 for k in ("unknown", "traverse", "traverse2")), got
            assert got["npm_traverse"][0] in (403, 404), got   # npm's upstream is not in its policy: 403 first
            everything = json.dumps(got) + r.stdout
            assert SECRET not in everything and "dsecuser" not in everything and "pypi.test" not in everything
            # the credentials went upstream (only there), and are nowhere a sandbox can read
            assert any(" Basic " in line for line in up.requests()), up.requests()
            leak = await sb.run(f"grep -rs {SECRET} /proc/self/environ /proc/1/environ /etc /tmp /root /home; "
                                "env | grep -c PKGCACHE_PYPI; ls / ", user="root")
            assert SECRET not in leak.stdout and "pkgcache" not in leak.stdout, leak.stdout
        finally:
            await sb.stop()
    # the store is the node's: root-only directory, files not writable by sandboxes' ids
    root = cxserver.home / "pkgcache"
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and os.stat(root).st_uid == 0
    held = root / "files" / "sha256" / digest[:2] / digest
    assert held.read_bytes() == wheel.read_bytes()
