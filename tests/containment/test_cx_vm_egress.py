"""A microVM's network (issue 25 for VMs): guest root with every address allowed reaches
neither this host (any of its addresses, its loopback through slirp's host alias, the
forwarder's and proxy's ports) nor another sandbox nor link-local metadata; names that
resolve to those are refused by the node proxy as for containers."""

from __future__ import annotations

import socket
import threading

import pytest

from egress_peer import probe, sandbox_ip, egress_peer, side_server


class _Listener:
    """A TCP listener on every address of this host that records whoever connects."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.listen(16)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                c, a = self.sock.accept()
            except OSError:
                return
            self.seen.append(a[0])
            c.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def cpeer(tmp_path_factory):
    from conftest import requires_root
    requires_root()
    with egress_peer(tmp_path_factory.mktemp("cx-vm-peer")) as p:
        p.set_zone({"allowed.test": p.ip})
        yield p


@pytest.fixture(scope="module")
def cserver(images, dsec_home, tmp_path_factory, cpeer):
    with side_server(dsec_home, tmp_path_factory, "cxvmegress", cpeer, vm=True) as srv:
        yield srv


async def test_vm_guest_reaches_neither_the_host_nor_another_sandbox(cserver, cpeer):
    async with cserver.client() as c:
        if "microvm" not in (await c.nodes())[0].backends:
            pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
        listener = _Listener()
        victim = await c.create_container(image="debian-python", network={"rules": [{"cidr": cpeer.ip2}]})
        vm = None
        try:
            await victim.run("nohup python3 -m http.server 8000 >/tmp/victim.log 2>&1 &", user="root")
            vip = sandbox_ip(cserver, victim.id)
            gw = vip.rsplit(".", 1)[0] + ".1"
            for _ in range(60):      # the victim does listen (on every address; its own loopback here)
                r = await probe(victim, [["self", "tcp", "127.0.0.1", 8000]])
                if r["self"] == "ok:connected":
                    break
            assert r["self"] == "ok:connected", r
            vm = await c.create_microvm(image="debian-python", network={"rules": [{"cidr": "0.0.0.0/0"}]})
            vm_ip = sandbox_ip(cserver, vm.id)
            lp = listener.port
            # every address allowed: the direct path (QEMU's sockets leaving its veth)
            r = await probe(vm, [
                ["control", "http", cpeer.ip2, 80, "x"],                      # egress itself works
                ["host_peer_side", "tcp", cpeer.host_ip, lp], ["gateway", "tcp", gw, lp],
                ["own_bridge_ip", "tcp", vm_ip, lp],
                ["slirp_host_alias", "tcp", "10.0.2.2", lp],                  # QEMU's netns loopback
                ["slirp_host_api", "tcp", "10.0.2.2", cserver.port],
                ["proxy_direct", "tcp", gw, 10080], ["dns_direct", "tcp", gw, 10053],
                ["victim", "tcp", vip, 8000], ["metadata", "http", "169.254.169.254", 80, "x"],
                ["ipv6_loop", "tcp6", "::1", lp],
            ])
            assert r["control"].startswith("ok:200"), r
            assert all(v.startswith("err:") for k, v in r.items() if k != "control" and not k.endswith(".s")), r
            # allowed names that resolve to the host, the gateway, the victim, metadata: the
            # node proxy (TCP 80/443 of a policy by name) refuses to connect there
            names = {"host.test": cpeer.host_ip, "gw.test": gw, "victim.test": vip, "meta.test": "169.254.169.254"}
            cpeer.set_zone({**names, "allowed.test": cpeer.ip})
            await vm.set_network(domains=sorted(names))
            checks = []
            for name in names:
                checks += [[f"http {name}", "http", cpeer.ip, 80, name], [f"https {name}", "https", cpeer.ip, 443, name]]
            r = await probe(vm, checks)
            leaked = {k: v for k, v in r.items() if not k.endswith(".s") and v.startswith("ok:") and
                      not v.startswith("ok:403") and not v.startswith("ok:502")}
            assert not leaked, r
            assert not listener.seen, listener.seen
            log = (await victim.run("cat /tmp/victim.log", user="root")).stdout
            assert "GET" not in log, log
        finally:
            listener.close()
            await victim.stop()
            if vm is not None:
                await vm.stop()
            cpeer.set_zone({"allowed.test": cpeer.ip})
