"""Attacks on the package cache's apt proxy (issue 25.4): a sandbox cannot change the apt.conf.d
file dsec binds, cannot use the proxy to reach the node (its API, the gateway, loopback), cannot
walk out of a mirror's paths, cannot tunnel (CONNECT) or write, and cannot make the cache fetch
a .deb that no Packages index named."""

from __future__ import annotations

import json

import pytest

from egress_peer import READ_ALL, peer, side_server  # noqa: F401 (fixtures)

# run in a sandbox: argv[1] is a JSON list of [name, method, url]; each sent proxy-style
# (absolute URL) to the cache named in the apt.conf.d file; prints {name: [status, body head]}
RAW = READ_ALL + r'''
import json, re, socket, sys
conf = open("/etc/apt/apt.conf.d/90dsec-pkgcache").read()
host, port = re.search(r'Proxy "http://([0-9.]+):([0-9]+)/"', conf).groups()
out = {}
for name, method, url in json.loads(sys.argv[1]):
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(("%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" % (method, url)).encode())
    data = read_all(s)
    head, _, body = data.partition(b"\r\n\r\n")
    out[name] = [int(head.split(b" ")[1]) if head else 0, body.decode("utf-8", "replace")[:300]]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def cxaserver(images, dsec_home, tmp_path_factory, request):
    ep = request.getfixturevalue("peer")
    with side_server(dsec_home, tmp_path_factory, "cx-pkgcache-apt", ep) as srv:
        yield srv, ep


async def test_the_apt_proxy_reaches_no_node_address_and_serves_only_named_files(cxaserver):
    srv, ep = cxaserver
    async with srv.client() as c:
        sb = await c.create_container(image="debian-python", network={"rules": [{"cidr": "0.0.0.0/0"}]})
        try:
            f = "/etc/apt/apt.conf.d/90dsec-pkgcache"
            r = await sb.run(f"cp {f} /tmp/before; echo 'Acquire::http::Proxy \"DIRECT\";' > {f}; rm -f {f}; "
                             f"cmp {f} /tmp/before && echo UNCHANGED; cat {f}", user="root")
            assert "UNCHANGED" in r.stdout and 'Acquire::http::Proxy "http://' in r.stdout, r.stdout
            gw = r.stdout.split('Proxy "http://', 1)[1].split(":", 1)[0]
            checks = [["api", "GET", f"http://127.0.0.1:{srv.port}/dists/x/InRelease"],
                      ["gateway", "GET", f"http://{gw}:10081/dists/x/InRelease"],
                      ["host", "GET", f"http://{ep.host_ip}:{srv.port}/dists/x/InRelease"],
                      ["connect", "CONNECT", f"{ep.ip}:443"],
                      ["post", "POST", f"http://{ep.ip}/debian/dists/x/InRelease"],
                      ["traverse", "GET", f"http://{ep.ip}/debian/pool/../../etc/x.deb"],
                      ["traverse_q", "GET", f"http://{ep.ip}/debian/pool/%2e%2e/%2e%2e/x.deb"],
                      ["not_apt", "GET", f"http://{ep.ip}/anything"],
                      ["unnamed", "GET", f"http://{ep.ip}/debian/pool/main/x/x/x_1_all.deb"]]
            await sb.files.write("/tmp/raw.py", RAW)
            r = await sb.run(f"python3 /tmp/raw.py '{json.dumps(checks)}'", timeout_s=180)
            assert r.exit_code == 0, r.stderr
            got = json.loads(r.stdout)
            for k in ("api", "gateway", "host"):   # never connected: the node's own addresses
                assert got[k][0] == 502 and "not reachable" in got[k][1], got
            assert got["connect"][0] == 405 and got["post"][0] == 405, got
            assert all(got[k][0] == 404 for k in ("traverse", "traverse_q", "not_apt")), got
            assert got["unnamed"][0] == 404 and "apt-get update" in got["unnamed"][1], got
        finally:
            await sb.stop()
