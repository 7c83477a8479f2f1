"""An edge's own network namespace on a shared host (cluster mode, opt-in: D40).

Several Ray nodes on one machine (the local cluster of the tests and `dsec bench cluster`) each
get `dsec-<node>`, a named netns (/run/netns) joined to the host by a veth pair on a /30 of the
cluster's `netns_pool`:

    host:   dsh<12 hex> <pool .1>/30, forwarding on; table inet dsec_ns_<node>:
            masquerade the netns' address to the uplink; nothing the netns starts reaches the
            host (input drop) or another netns (forward drop), replies excepted
    netns:  eth0 <pool .2>/30, default route via the host end; lo; the edge's bridge, nft table
            and sandbox veths (network.py, run inside it) and its HTTP service on <pool .2>

Only the edge's process lives in it (edge_proc.py; entered with nsenter --net, keeping the host
mount namespace). The netns outlives the edge process on purpose: an edge Ray restarts adopts
the plugged sandboxes of the one before, whose veths are on the bridge in there. `remove()`
deletes it (local_cluster's teardown, `dsec cluster down` when no sandbox is plugged in).
Names are per Ray node, so concurrent clusters on one host do not collide; /30s come from the
pool by the edge's subnet index, as unique per cluster as the subnets.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dsec.cluster.names import link_tag
from dsec.types import InvalidArgument, SandboxFailed, Unavailable

log = logging.getLogger("dsec.cluster.netns")

NETNS_DIR = Path("/run/netns")
STATE_DIR = Path("/run/dsec/netns")       # the host uplinks' forwarding values before the first netns
NAME_PREFIX = "dsec-"
HOST_IF_PREFIX = "dsh"
NS_IF = "eth0"
DEFAULT_POOL = "10.89.0.0/16"


@dataclass(frozen=True)
class EdgeNetns:
    node_id: str                 # the dsec node name (cluster/names.py)
    link: str                    # its /30: .1 the host end, .2 the netns end

    @property
    def name(self) -> str:
        return NAME_PREFIX + self.node_id

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    @property
    def host_if(self) -> str:
        return HOST_IF_PREFIX + link_tag(self.node_id, 15 - len(HOST_IF_PREFIX))

    @property
    def nft_table(self) -> str:
        return f"dsec_ns_{self.node_id}".replace("-", "_")

    @property
    def host_ip(self) -> str:
        return str(ipaddress.IPv4Network(self.link).network_address + 1)

    @property
    def ns_ip(self) -> str:
        return str(ipaddress.IPv4Network(self.link).network_address + 2)

    def to_json(self) -> dict[str, str]:
        return {"node_id": self.node_id, "link": self.link}

    @classmethod
    def from_json(cls, d: dict[str, str]) -> "EdgeNetns":
        return cls(d["node_id"], d["link"])


def link_for(pool: str, index: int) -> str:
    """The index-th /30 of `pool` (an edge's index in the subnet pool)."""
    try:
        net = ipaddress.IPv4Network(pool)
    except ValueError as e:
        raise InvalidArgument(f"netns_pool {pool!r} is not an IPv4 network: {e}", field="netns_pool",
                              fix="use a CIDR such as 10.89.0.0/16") from None
    if net.prefixlen > 30 or index >= net.num_addresses // 4:
        raise InvalidArgument(f"netns_pool {pool} has no /30 left for edge #{index + 1}", field="netns_pool",
                              fix="use a larger pool (a /30 per edge)")
    return str(ipaddress.IPv4Network((int(net.network_address) + 4 * index, 30)))


def _ip(*argv: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *argv], input=stdin, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SandboxFailed(f"ip {' '.join(argv[:4])} failed (exit {p.returncode}): {p.stderr.strip()[-500:]}",
                            fix="the host needs iproute2 and root (scripts/install.sh)")
    return p


def _nft(*argv: str) -> int:
    try:
        return subprocess.run(["nft", *argv], capture_output=True).returncode
    except FileNotFoundError:     # no nftables: no table either
        return -1


def _link_exists(name: str) -> bool:
    return (Path("/sys/class/net") / name).exists()      # this process is in the host netns


@contextmanager
def _host_lock() -> Iterator[None]:
    """Edges of one host set up at the same time: the forwarding record is read-modify-write."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _uplinks() -> list[str]:
    p = _ip("-j", "route", "show", "default", check=False)
    try:
        return sorted({r["dev"] for r in json.loads(p.stdout or "[]") if r.get("dev")})
    except (ValueError, TypeError):
        return []


def _sysctl(path: str, value: str | None = None) -> str | None:
    p = Path("/proc/sys/net/ipv4/conf") / path / "forwarding"
    try:
        old = p.read_text().strip()
        if value is not None and old != value:
            p.write_text(value)
        return old
    except FileNotFoundError:
        return None


def _nft_rules(ns: EdgeNetns) -> str:
    t, hif = ns.nft_table, json.dumps(ns.host_if)
    return f"""table inet {t} {{}}
flush table inet {t}
table inet {t} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {ns.ns_ip} oifname != {hif} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    oifname {hif} ct state established,related accept
    oifname {hif} drop
    iifname {hif} ip daddr 169.254.0.0/16 drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname {hif} ct state established,related accept
    iifname {hif} drop
  }}
}}
"""


def ensure(ns: EdgeNetns) -> None:
    """Create (or complete) the netns, its veth pair, routes and the host's rules. Idempotent;
    never recreates a netns that exists (its bridge holds live sandboxes' veths)."""
    for tool, pkg in (("ip", "iproute2"), ("nft", "nftables"), ("nsenter", "util-linux")):
        if not shutil.which(tool):
            raise Unavailable(f"an edge network namespace needs `{tool}`", fix=f"apt-get install {pkg}")
    with _host_lock():
        if not ns.path.exists():
            _ip("netns", "add", ns.name)
            log.info("created edge network namespace", extra={"netns": ns.name, "link": ns.link})
        if not _link_exists(ns.host_if):
            _ip("link", "add", ns.host_if, "type", "veth", "peer", "name", NS_IF, "netns", ns.name)
        _ip("-batch", "-", stdin=f"addr replace {ns.host_ip}/30 dev {ns.host_if}\n"
                                 f"link set dev {ns.host_if} up\n")
        _ip("-n", ns.name, "-batch", "-", stdin=f"link set dev lo up\n"
                                                f"addr replace {ns.ns_ip}/30 dev {NS_IF}\n"
                                                f"link set dev {NS_IF} up\n"
                                                f"route replace default via {ns.host_ip} dev {NS_IF}\n")
        _sysctl(ns.host_if, "1")            # IPv4 forwards what arrives on an interface with it on
        saved = STATE_DIR / "forwarding.json"
        old = json.loads(saved.read_text()) if saved.exists() else {}
        for dev in _uplinks():              # replies from the uplink back into the netns
            if dev.startswith(HOST_IF_PREFIX):
                continue
            prev = _sysctl(dev, "1")
            if prev is not None and dev not in old:
                old[dev] = prev
        saved.write_text(json.dumps(old))
        p = subprocess.run(["nft", "-f", "-"], input=_nft_rules(ns), capture_output=True, text=True)
        if p.returncode != 0:
            raise SandboxFailed(f"nft rules for {ns.name} failed: {p.stderr.strip()[-500:]}",
                                fix="the host needs nftables (scripts/install.sh)")


def plugged_sandboxes(ns: EdgeNetns) -> list[str]:
    """The sandbox veths (network.py's dsv*) in the netns: what its removal would cut off."""
    if not ns.path.exists():
        return []
    p = _ip("-n", ns.name, "-j", "link", "show", check=False)
    try:
        return sorted(link["ifname"] for link in json.loads(p.stdout or "[]")
                      if str(link.get("ifname", "")).startswith("dsv"))
    except (ValueError, TypeError):
        return []


def remove(node_id: str) -> bool:
    """Delete the node's netns, veth pair and host rules (whatever of them exists); restore the
    uplinks' forwarding once no dsec netns is left. Returns whether anything was there."""
    ns = EdgeNetns(node_id, "0.0.0.0/30")
    found = False
    with _host_lock():
        if _link_exists(ns.host_if):
            _ip("link", "del", ns.host_if, check=False)      # both ends go
            found = True
        if ns.path.exists():
            _ip("netns", "del", ns.name, check=False)
            found = True
        if _nft("delete", "table", "inet", ns.nft_table) == 0:
            found = True
        if not any(NETNS_DIR.glob(NAME_PREFIX + "*")):
            saved = STATE_DIR / "forwarding.json"
            if saved.exists():
                for dev, value in json.loads(saved.read_text()).items():
                    _sysctl(dev, value)
                saved.unlink()
    if found:
        log.info("removed edge network namespace", extra={"netns": ns.name})
    return found


def leftovers(node_ids: list[str]) -> list[str]:
    """What of these nodes' namespaces is still on the host (tests: nothing after teardown)."""
    out = []
    for node in node_ids:
        ns = EdgeNetns(node, "0.0.0.0/30")
        if ns.path.exists():
            out.append(str(ns.path))
        if _link_exists(ns.host_if):
            out.append(ns.host_if)
        if _nft("list", "table", "inet", ns.nft_table) == 0:
            out.append(f"nft table {ns.nft_table}")
    return out
