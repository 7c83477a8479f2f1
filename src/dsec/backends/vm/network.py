"""A VM's network: its QEMU, not its guest, is the sandbox the node's network policy governs.

A VM created with `network` gets a virtio-net NIC on QEMU's user-mode network (slirp): every
connection the guest makes becomes a socket of its QEMU process. That QEMU runs in a network
namespace of its own (`unshare --net`, qemu.launch) and is started as a member of a cgroup of
its own (at the path a container of the same id would have), whose policy programs are
attached before QEMU exists: every socket it ever makes, one for a guest's flow before the
VM is plugged in included, is the sandbox's. The node's `SandboxNetworks` (the
containers' one instance: bridge, IPAM, cgroup-BPF policy, nft sets, DNS forwarder, egress
proxy) then treats the QEMU exactly as a container's init: the BPF programs on its cgroup
decide each connect()/sendmsg(), the first allow plugs a veth into its namespace, port 53 goes
to the forwarder, TCP 80/443 of a policy with domains to the egress proxy (SNI/Host). Guest
root cannot change any of this: the guest has no socket on the host, only frames that slirp
turns into QEMU's sockets (decision D6x in docs/decisions.md).

The policy's allow-list is kept in the VM's dir (`net.json`) as well as in the edge's SQLite:
a parked VM's QEMU (and so its namespace, veth and address) is gone, and the resumed QEMU is
plugged in again with the same list.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from dsec.security.netpolicy import Allow, Rulesets, resolve
from dsec.types import InvalidArgument, NetworkPolicy, SandboxFailed

log = logging.getLogger("dsec.backends.vm")

NET_FILE = "net.json"


class NodeNetwork(Protocol):
    """What a VM needs of the node's sandbox networks (backends/container/network.py's
    SandboxNetworks, handed over by the composition root)."""

    @property
    def gateway(self) -> str: ...

    def cgroup_of(self, sandbox_id: str) -> Path: ...

    def add_live_source(self, live: Callable[[], dict[str, int]]) -> None: ...

    def allows_of(self, sandbox_id: str) -> list[Allow]: ...

    async def setup(self, sandbox_id: str, pid: int, allows: list[Allow]) -> None: ...

    async def apply(self, sandbox_id: str, pid: int, allows: list[Allow]) -> None: ...

    async def release(self, sandbox_id: str) -> None: ...


class VMNetwork:
    def __init__(self, node: NodeNetwork, rulesets: Rulesets):
        self.node = node
        self.rulesets = rulesets

    @property
    def resolver(self) -> str:
        """The address the guest's /etc/resolv.conf names (any port 53 reaches the forwarder)."""
        return self.node.gateway

    def resolve(self, policy: NetworkPolicy, field: str = "network") -> list[Allow]:
        if policy.egress_proxy is not None:
            raise InvalidArgument(f"{field + '.' if field else ''}egress_proxy: VM sandboxes cannot be tunnelled "
                                  "through a SOCKS5 proxy yet", field=f"{field + '.' if field else ''}egress_proxy",
                                  fix="use a container sandbox for an egress proxy, or leave egress_proxy unset")
        return resolve(policy, self.rulesets, field=field)

    async def prepare(self, sandbox_id: str, d: Path, allows: list[Allow]) -> Path:
        """Before QEMU starts: the policy kept in `d`, the cgroup made with the policy programs
        attached (deny all). Returns the cgroup QEMU must be started in (Machine.cgroup)."""
        _save(d, allows)
        cg = self.node.cgroup_of(sandbox_id)
        try:
            await asyncio.to_thread(cg.mkdir, parents=True, exist_ok=True)
        except OSError as e:
            raise SandboxFailed(f"could not make VM {sandbox_id}'s cgroup {cg}: {e}",
                                fix="cgroup v2 must be mounted (scripts/host-setup.sh)") from e
        await self.node.setup(sandbox_id, 0, [])
        return cg

    async def plug(self, sandbox_id: str, pid: int, allows: list[Allow]) -> None:
        """After QEMU started (in its cgroup and empty netns): the policy, and the veth when
        it allows anything."""
        if allows:
            await self.node.apply(sandbox_id, pid, allows)

    async def set_policy(self, sandbox_id: str, d: Path, pid: int, allows: list[Allow]) -> None:
        await self.node.apply(sandbox_id, pid, allows)
        _save(d, allows)

    async def detach(self, sandbox_id: str) -> None:
        """After its QEMU exited (stop or park): address, veth, map entries and the cgroup."""
        await self.node.release(sandbox_id)
        await _remove_cgroup(self.node.cgroup_of(sandbox_id))


def saved_allows(d: Path) -> list[Allow]:
    try:
        return [Allow.from_json(a) for a in json.loads((d / NET_FILE).read_text())]
    except FileNotFoundError:
        return []


def _save(d: Path, allows: list[Allow]) -> None:
    tmp = d / (NET_FILE + ".tmp")
    tmp.write_text(json.dumps([a.to_json() for a in allows]))
    os.replace(tmp, d / NET_FILE)


async def _remove_cgroup(cg: Path) -> None:
    """rmdir once the exited QEMU has left it (a few ms after its death at most)."""
    for _ in range(200):
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:       # EBUSY: the dying process is still a member
            await asyncio.sleep(0.01)
    log.warning("VM cgroup not removed", extra={"cgroup": str(cg)})
