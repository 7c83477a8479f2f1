"""Container sandbox networking: cgroup-BPF policy on every sandbox, a veth only when needed.

Every sandbox starts in a private network namespace with only loopback, and gets the
network-policy BPF programs attached to its cgroup at creation (a handful of bpf() calls; with no
map entries they deny everything but loopback, with EPERM). The first time its policy allows
anything, it is plugged in:

    host:     bridge <bridge> (gateway = first address of <subnet>), NAT to the uplink (nftables)
    sandbox:  veth "eth0" <ip>/<prefix>, default route via the gateway; host end "dsv<12 hex>"
              on the bridge as an *isolated* port (sandboxes cannot reach each other at L2)

IPs come from a small IPAM in the edge's SQLite (table net_sandboxes), so an edge restart keeps
them. The bridge and the NAT table exist only while at least one sandbox is plugged in; the
host itself (any address, any port) is never reachable from the bridge (nft input drop), nor are
link-local metadata services. IPv4 only for now; IPv6 rules are enforced but not routed.

Cleanup never depends on this process surviving: veths die with the sandbox's network
namespace, BPF attachments with its cgroup (no links, nothing pinned); what is left (IPAM rows,
map entries, a veth whose namespace is kept alive) is reconciled by `release()` and `recover()`.
One dsec instance per bridge: instances sharing a host set DSEC_NET_BRIDGE / DSEC_NET_SUBNET.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import shutil
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.container.dns import DnsServer, SandboxView, Upstream, parse_upstream
from dsec.backends.container.egress_proxy import EgressProxy
from dsec.backends.container.pkgcache import PackageCache, sandbox_env
from dsec.pkgcache.apt import apt_conf
from dsec.pkgcache.store import BlobStore
from dsec.backends.container.secret_rules import SecretRules
from dsec.backends.container.tls_intercept import Interceptor
from dsec.security.egress_ca import EgressCA
from dsec.config import Paths
from dsec.security.netpolicy import (PROTO_BITS, Allow, PolicyProgram, compile_allows, domains_of, egress_allows,
                                     kernel_allows, tunnel_of)
from dsec.types import InvalidArgument, SandboxFailed, Unavailable

log = logging.getLogger("dsec.backends.container.network")

VETH_PREFIX = "dsv"
SANDBOX_IFNAME = "eth0"

SCHEMA = """
CREATE TABLE IF NOT EXISTS net_sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    ip TEXT UNIQUE,              -- NULL until the sandbox is first plugged in
    cgid INTEGER NOT NULL,       -- cgroup id: the key of its BPF map entries
    allows TEXT NOT NULL,        -- resolved allow-list (JSON) currently in the BPF maps
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS net_meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
"""


@dataclass(frozen=True)
class NetSettings:
    bridge: str = "dsec0"
    subnet: str = "10.88.0.0/16"
    dns_upstream: str = ""        # the forwarder's resolver; empty: the host's first nameserver
    dns_port: int = 10053         # forwarder on the gateway (sandboxes' port 53 is sent there)
    proxy_port: int = 10080       # egress proxy on the gateway (domain-mode TCP 80/443)
    upstream_ca_file: str = ""    # trust for destinations the proxy adds secrets to; empty: the host's
    pkgcache_port: int = 10081    # the package cache on the gateway (issue 25.4); 0: none
    pkgcache_max_bytes: int = 10 << 30
    pkgcache_pypi_url: str = "https://pypi.org/simple/"
    pkgcache_npm_url: str = "https://registry.npmjs.org/"
    pkgcache_index_ttl_s: float = 300.0

    @classmethod
    def of(cls, group) -> "NetSettings":
        """From dsec.settings.NetworkSettings."""
        return cls(group.bridge, group.subnet, group.dns_upstream, group.dns_port, group.proxy_port,
                   group.upstream_ca_file, group.pkgcache_port, group.pkgcache_max_bytes, group.pkgcache_pypi_url,
                   group.pkgcache_npm_url, group.pkgcache_index_ttl_s)

    def __post_init__(self) -> None:
        net = ipaddress.IPv4Network(self.subnet)       # raises on a bad value at startup
        if net.prefixlen > 28 or len(self.bridge) > 15:
            raise ValueError(f"DSEC_NET_SUBNET must be an IPv4 network of /28 or larger and "
                             f"DSEC_NET_BRIDGE at most 15 characters, got {self.subnet!r}, {self.bridge!r}")
        try:
            parse_upstream(self.dns_upstream)
        except ValueError:
            raise ValueError(f"DSEC_NET_DNS_UPSTREAM must be IP, IP:PORT or [IPv6]:PORT, "
                             f"got {self.dns_upstream!r}") from None

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return self.network.network_address + 1

    @property
    def nft_table(self) -> str:
        return f"dsec_{self.bridge}".replace("-", "_")


def veth_name(sandbox_id: str) -> str:
    tail = sandbox_id.rsplit(".", 1)[-1]
    if len(tail) != 12:
        import hashlib
        tail = hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]
    return VETH_PREFIX + tail


async def _run(*argv: str, stdin: str | None = None, check: bool = True) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate(stdin.encode() if stdin is not None else None)
    text = out.decode(errors="replace").strip()
    if check and proc.returncode != 0:
        raise SandboxFailed(f"{' '.join(argv[:3])} failed (exit {proc.returncode}): {text[-1000:]}",
                            fix="see the edge log; the host needs iproute2 and nftables (scripts/install.sh)")
    return proc.returncode or 0, text


def _link_exists(name: str) -> bool:
    """In this process's network namespace, which need not be /sys's: an edge in a netns of its
    own (cluster mode, D40) keeps the host's mount namespace and so the host's /sys/class/net."""
    try:
        socket.if_nametoindex(name)
        return True
    except OSError:
        return False


def _write_sysctl(path: str, value: str) -> str | None:
    """Write a /proc/sys value; return the previous one (None if the knob does not exist)."""
    p = Path("/proc/sys") / path
    try:
        old = p.read_text().strip()
        if old != value:
            p.write_text(value)
        return old
    except FileNotFoundError:
        return None


class SandboxNetworks:
    def __init__(self, paths: Paths, cgroup_dir, settings: NetSettings | None = None):
        self.paths = paths
        self.settings = settings or NetSettings()
        self._cgroup_dir = cgroup_dir            # sandbox id -> its cgroup v2 directory
        self._db = sqlite3.connect(str(paths.edge_db), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._dblock = threading.Lock()
        self._rows: dict[str, dict] = {r["sandbox_id"]: r for r in self._select()}
        self._prog: PolicyProgram | None = None
        self._prog_error: Exception | None = None
        self._prog_lock = threading.Lock()
        self._resolv_seen: tuple[int, int, int] | None = None   # resolv_conf(): the file last checked
        self._apt_conf_seen: str | None = None   # apt_conf(): the text last written
        self._cgids: dict[str, int] = {}          # sandbox id -> cgroup id, for every attached sandbox
        self._by_ip: dict[str, str] = {r["ip"]: sid for sid, r in self._rows.items() if r["ip"]}
        self._domain_ips: set[str] = set()        # in the nft set: TCP 80/443 go to the egress proxy
        self._tunnel_ips: set[str] = set()        # in the nft set tunnel4: all TCP goes to the egress proxy
        self._dns: DnsServer | None = None
        self._proxy: EgressProxy | None = None
        self._cache: PackageCache | None = None
        self.secrets = SecretRules()              # issue 30: rules the egress proxy adds secrets by
        self._ca: EgressCA | None = None
        self._ca_lock = threading.Lock()
        self._locks: dict[str, asyncio.Lock] = {}
        self._infra_lock = asyncio.Lock()
        self._infra_ready = False
        # other backends whose sandboxes are plugged in here too (VMs: their QEMU's netns and
        # cgroup): each gives its live sandbox id -> pid, so recover() keeps their rows
        self._live_sources: list[Callable[[], dict[str, int]]] = []
        self._cursor = int(self._meta("ipam_cursor") or max(
            [int(ipaddress.IPv4Address(r["ip"])) for r in self._rows.values() if r["ip"]],
            default=int(self.settings.gateway)))

    # -- persistence ---------------------------------------------------------------------
    def _select(self) -> list[dict]:
        with self._dblock:
            rows = self._db.execute("SELECT sandbox_id, ip, cgid, allows FROM net_sandboxes").fetchall()
        return [{"sandbox_id": r[0], "ip": r[1], "cgid": r[2], "allows": [Allow.from_json(a) for a in json.loads(r[3])]}
                for r in rows]

    def _save(self, row: dict) -> None:
        self._rows[row["sandbox_id"]] = row
        if row["ip"]:
            self._by_ip[row["ip"]] = row["sandbox_id"]
        with self._dblock:
            self._db.execute("INSERT OR REPLACE INTO net_sandboxes VALUES (?,?,?,?,?)",
                             (row["sandbox_id"], row["ip"], row["cgid"],
                              json.dumps([a.to_json() for a in row["allows"]]), time.time()))

    def _forget(self, sandbox_id: str) -> None:
        row = self._rows.pop(sandbox_id, None)
        if row and row["ip"]:
            self._by_ip.pop(row["ip"], None)
        with self._dblock:
            self._db.execute("DELETE FROM net_sandboxes WHERE sandbox_id=?", (sandbox_id,))

    def _meta(self, k: str, v: str | None = None, delete: bool = False) -> str | None:
        with self._dblock:
            if delete:
                self._db.execute("DELETE FROM net_meta WHERE k=?", (k,))
                return None
            if v is not None:
                self._db.execute("INSERT OR REPLACE INTO net_meta VALUES (?,?)", (k, v))
                return v
            r = self._db.execute("SELECT v FROM net_meta WHERE k=?", (k,)).fetchone()
            return r[0] if r else None

    def cgroup_of(self, sandbox_id: str) -> Path:
        """The cgroup v2 directory whose processes' sockets the sandbox's policy governs."""
        return Path(self._cgroup_dir(sandbox_id))

    def add_live_source(self, live: Callable[[], dict[str, int]]) -> None:
        """Another backend's running networked sandboxes (id -> pid), kept by recover()."""
        self._live_sources.append(live)

    @property
    def gateway(self) -> str:
        """The bridge address: the sandboxes' resolver (port 53 is the forwarder's)."""
        return str(self.settings.gateway)

    def allows_of(self, sandbox_id: str) -> list[Allow]:
        """The sandbox's egress policy now (none: deny all)."""
        row = self._rows.get(sandbox_id)
        return list(row["allows"]) if row else []

    def ip_of(self, sandbox_id: str) -> str | None:
        row = self._rows.get(sandbox_id)
        return row["ip"] if row else None

    def view_of_ip(self, ip: str) -> SandboxView | None:
        """The policy of the sandbox holding a bridge address (the DNS forwarder's and the egress
        proxy's lookup, per query and per connection: a set_network counts at once)."""
        sid = self._by_ip.get(ip)
        row = self._rows.get(sid) if sid else None
        if row is None:
            return None
        return SandboxView(sid, bool(egress_allows(row["allows"])), domains_of(row["allows"]), row["allows"])

    def egress_ca(self) -> EgressCA:
        """The node's egress CA (one instance: made on first use, by the first sandbox with secrets)."""
        with self._ca_lock:
            if self._ca is None:
                self._ca = EgressCA(self.paths.home / "egress-ca")
            return self._ca

    async def set_secrets(self, sandbox_id: str, rules: list) -> None:
        """Issue 30: the sandbox's secret rules; its TCP 80/443 goes to the egress proxy from
        now on (which splices what no rule names, untouched)."""
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            self.secrets.set(sandbox_id, rules)
            row = self._rows.get(sandbox_id)
            if row and row["ip"]:
                async with self._infra_lock:
                    await self._domain_mode(row["ip"], True)

    def resolv_conf(self) -> Path:
        """The file every container sees as /etc/resolv.conf (spec.py): the gateway, where its
        port 53 is answered by the forwarder when its policy allows egress."""
        path = self.paths.home / "net" / f"resolv-{self.settings.bridge}.conf"
        # every create asks: a stat is enough while the file is the one checked last time
        try:
            st = os.stat(path)
            if (st.st_ino, st.st_mtime_ns, st.st_size) == self._resolv_seen:
                return path
        except FileNotFoundError:
            pass
        _write_if_changed(path, f"nameserver {self.settings.gateway}\noptions timeout:2 attempts:2\n")
        st = os.stat(path)
        self._resolv_seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        return path

    def _cache_allows(self, allows: list[Allow]) -> list[Allow]:
        """The package cache on the gateway, for a sandbox with any egress that is not tunnelled
        (a tunnelled one's TCP all goes to its SOCKS server; nft sends this there too and the
        proxy refuses the gateway): kernel entries only, never stored as the sandbox's policy."""
        port = self.settings.pkgcache_port
        if not port or not egress_allows(allows) or tunnel_of(allows) is not None:
            return []
        extra = [Allow(f"{self.settings.gateway}/32", port, port, PROTO_BITS["tcp"])]
        try:   # the entry inherits the ranges of rules covering the gateway: never push one past the bound
            compile_allows(kernel_allows(allows + extra))
        except InvalidArgument:
            return []
        return extra

    def apt_conf(self) -> Path | None:
        """The apt.conf.d file Debian-based sandboxes that get the cache's env see (spec.py):
        apt's HTTP proxy is the cache. None when the cache is off."""
        s = self.settings
        if not s.pkgcache_port:
            return None
        path = self.paths.home / "net" / f"apt-{s.bridge}.conf"
        text = apt_conf(str(s.gateway), s.pkgcache_port)
        if self._apt_conf_seen != text or not path.exists():   # a stat per create, a write once
            _write_if_changed(path, text)
            self._apt_conf_seen = text
        return path

    def sandbox_env(self) -> dict[str, str]:
        """pip's and npm's settings naming the cache (none when it is off)."""
        s = self.settings
        return sandbox_env(str(s.gateway), s.pkgcache_port) if s.pkgcache_port else {}

    # -- BPF -----------------------------------------------------------------------------
    def program(self) -> PolicyProgram:
        """The edge's loaded policy program (compiled and loaded on first use)."""
        with self._prog_lock:
            if self._prog is None and self._prog_error is None:
                try:
                    self._prog = PolicyProgram(self.paths.bin)
                except Exception as e:   # no clang/libbpf, or the kernel refuses: remembered, not retried
                    self._prog_error = e
                    log.error("network policy unavailable", extra={"error": str(e)})
            if self._prog is None:
                err = self._prog_error
                raise err if isinstance(err, Unavailable) else Unavailable(f"network policy unavailable: {err}")
            return self._prog

    # -- per sandbox ---------------------------------------------------------------------
    async def setup(self, sandbox_id: str, pid: int, allows: list[Allow]) -> None:
        """At creation (the agent runs, no user command yet): attach the policy programs and,
        if the policy allows anything, plug the sandbox in."""
        try:
            prog = await asyncio.to_thread(self.program)
        except Unavailable:
            if allows:
                raise
            return   # deny-all and no BPF here: the sandbox has no route anywhere anyway
        try:
            self._cgids[sandbox_id] = prog.attach(self._cgroup_dir(sandbox_id), fresh=True)
        except OSError as e:
            if allows:
                raise SandboxFailed(f"could not attach the network policy to sandbox {sandbox_id}: {e}",
                                    fix="see the edge log; cgroup v2 must be mounted") from e
            log.warning("network policy not attached to a deny-all sandbox (it has no route anyway)",
                        extra={"sandbox": sandbox_id, "error": str(e)})
            return
        if allows:
            await self.apply(sandbox_id, pid, allows)

    async def apply(self, sandbox_id: str, pid: int, allows: list[Allow]) -> None:
        """Replace the policy of a running sandbox: a map update; the first allow plugs it in."""
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            prog = await asyncio.to_thread(self.program)
            cgid = self._cgids.get(sandbox_id)
            if cgid is None:   # e.g. attached by an earlier edge process: re-attach this generation
                cgid = self._cgids[sandbox_id] = prog.attach(self._cgroup_dir(sandbox_id))
            row = self._rows.get(sandbox_id)
            old = row["allows"] if row else []
            domains = bool(domains_of(allows)) or self.secrets.has(sandbox_id)
            tunnel = tunnel_of(allows) is not None
            if domains and row and row["ip"]:
                await self._domain_mode(row["ip"], True)   # the redirect before BPF lets 80/443 out
            if tunnel and row and row["ip"]:
                await self._tunnel_mode(row["ip"], True)   # the redirect before BPF lets any TCP out
            prog.write(cgid, allows + self._cache_allows(allows))   # deny before a link exists; new connections now
            if not domains and row and row["ip"]:
                await self._domain_mode(row["ip"], False)
            if not tunnel and row and row["ip"]:
                await self._tunnel_mode(row["ip"], False)
            if row is None and not allows:
                return
            new_row = {"sandbox_id": sandbox_id, "ip": row["ip"] if row else None, "cgid": cgid, "allows": allows}
            if allows and new_row["ip"] is None:
                try:
                    async with self._infra_lock:
                        await self._ensure_infra()
                        new_row["ip"] = self._allocate()
                        self._save(new_row)   # durable before the veth exists
                        if domains:
                            await self._domain_mode(new_row["ip"], True)
                        if tunnel:
                            await self._tunnel_mode(new_row["ip"], True)
                    t0 = time.monotonic()
                    await self._plug(sandbox_id, pid, new_row["ip"])
                    log.info("sandbox plugged into the bridge",
                             extra={"sandbox": sandbox_id, "ip": new_row["ip"],
                                    "ms": round((time.monotonic() - t0) * 1000, 1)})
                except BaseException:
                    await asyncio.shield(self._unplug(sandbox_id))
                    if new_row["ip"]:
                        await asyncio.shield(self._domain_mode(new_row["ip"], False))
                        await asyncio.shield(self._tunnel_mode(new_row["ip"], False))
                    if row:
                        self._save(row)
                    else:
                        self._forget(sandbox_id)
                    prog.write(cgid, old + self._cache_allows(old))
                    await asyncio.shield(self._maybe_teardown())
                    raise
            else:
                self._save(new_row)

    async def release(self, sandbox_id: str) -> None:
        """After the container is gone: map entries, IP, veth. Idempotent; cheap when unplugged."""
        lock = self._locks.pop(sandbox_id, None)
        if lock is not None:
            async with lock:   # let an apply() in flight finish, then undo it
                pass
        cgid = self._cgids.pop(sandbox_id, None)
        row = self._rows.get(sandbox_id)
        if row is not None:
            cgid = cgid or row["cgid"]
        if cgid is not None and self._prog is not None:
            self._prog.clear(cgid)
        if row is None:
            if _link_exists(veth_name(sandbox_id)):   # plugged, then killed before the row was read
                await self._unplug(sandbox_id)
            return
        await self._unplug(sandbox_id)
        if row["ip"]:
            await self._domain_mode(row["ip"], False)
            await self._tunnel_mode(row["ip"], False)
        self._forget(sandbox_id)
        await self._maybe_teardown()

    async def recover(self, live: dict[str, int]) -> None:
        """After an edge restart. `live`: running sandbox id -> agent pid. Frees what dead
        sandboxes left; re-attaches this process's programs to every live sandbox (the old
        generation keeps enforcing until then) and re-writes the policies it knew."""
        for source in self._live_sources:
            live = {**source(), **live}
        for sid in [s for s in self._rows if s not in live]:
            log.warning("releasing network of a dead sandbox", extra={"sandbox": sid})
            await self.release(sid)
        try:
            prog = await asyncio.to_thread(self.program)
        except Unavailable:
            prog = None
        for sid in live:
            if prog is None:
                break
            try:
                self._cgids[sid] = prog.attach(self._cgroup_dir(sid))
            except OSError as e:
                log.warning("could not re-attach network policy", extra={"sandbox": sid, "error": str(e)})
                continue
            row = self._rows.get(sid)
            if row is not None:
                prog.write(self._cgids[sid], row["allows"] + self._cache_allows(row["allows"]))
                if row["cgid"] != self._cgids[sid]:
                    self._save({**row, "cgid": self._cgids[sid]})
        if any(r["ip"] for r in self._rows.values()):
            async with self._infra_lock:
                await self._ensure_infra()
        else:
            await self._maybe_teardown()

    # -- IPAM ----------------------------------------------------------------------------
    def _allocate(self) -> str:
        """Next free address after the last one handed out (no immediate reuse: stale conntrack
        entries of a freed address must not reach its next owner)."""
        net = self.settings.network
        first, last = int(self.settings.gateway) + 1, int(net.broadcast_address) - 1
        used = {r["ip"] for r in self._rows.values() if r["ip"]}
        size = last - first + 1
        for i in range(size):
            cand = first + (self._cursor - first + 1 + i) % size
            ip = str(ipaddress.IPv4Address(cand))
            if ip not in used:
                self._cursor = cand
                self._meta("ipam_cursor", str(cand))   # round robin survives restarts too
                return ip
        raise Unavailable(f"no free address left in {net} for another networked sandbox",
                          fix="set DSEC_NET_SUBNET to a larger network")

    # -- links ---------------------------------------------------------------------------
    async def _plug(self, sandbox_id: str, pid: int, ip: str) -> None:
        veth, s = veth_name(sandbox_id), self.settings
        await _run("ip", "-batch", "-", stdin="\n".join([
            f"link add {veth} type veth peer name {SANDBOX_IFNAME} netns {pid}",
            f"link set dev {veth} addrgenmode none",
            f"link set dev {veth} master {s.bridge}",
            f"link set dev {veth} type bridge_slave isolated on",
            f"link set dev {veth} up", ""]))
        await _run("nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-", stdin="\n".join([
            f"link set dev {SANDBOX_IFNAME} addrgenmode none",
            f"addr add {ip}/{s.network.prefixlen} dev {SANDBOX_IFNAME}",
            f"link set dev {SANDBOX_IFNAME} up",
            f"route add default via {s.gateway} dev {SANDBOX_IFNAME}", ""]))

    async def _unplug(self, sandbox_id: str) -> None:
        veth = veth_name(sandbox_id)
        if _link_exists(veth):
            await _run("ip", "link", "del", veth, check=False)

    async def _bridge_ports(self) -> list[str]:
        if not _link_exists(self.settings.bridge):
            return []
        _, out = await _run("ip", "-j", "link", "show", "master", self.settings.bridge, check=False)
        try:
            return sorted(str(link["ifname"]) for link in json.loads(out or "[]"))
        except (ValueError, TypeError, KeyError):
            return []

    # -- node infrastructure (bridge, NAT), present only while a sandbox is plugged in --------
    def _nft_rules(self) -> str:
        s, t = self.settings, self.settings.nft_table
        br = json.dumps(s.bridge)
        gw = s.gateway
        ips = sorted(self._domain_ips)
        elements = f"elements = {{ {', '.join(ips)} }}" if ips else ""
        tips = sorted(self._tunnel_ips)
        # the package cache is dialled directly (BPF allows it only to sandboxes with egress)
        cache = f"\n    iifname {br} ip daddr {gw} tcp dport {s.pkgcache_port} accept" if s.pkgcache_port else ""
        telements = f"elements = {{ {', '.join(tips)} }}" if tips else ""
        # deleted and made again in one transaction: `flush table` keeps set elements, and a
        # stale address in tunnel4/domain4 would follow the address to its next sandbox
        return f"""table inet {t} {{}}
delete table inet {t}
table inet {t} {{
  set domain4 {{
    type ipv4_addr
    {elements}
  }}
  set tunnel4 {{
    type ipv4_addr
    {telements}
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname {br} meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gw}:{s.dns_port}
    iifname {br} ip saddr @domain4 tcp dport {{ 80, 443 }} dnat ip to {gw}:{s.proxy_port}
    iifname {br} ip saddr @tunnel4 meta l4proto tcp dnat ip to {gw}:{s.proxy_port}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {s.network} oifname != {br} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname {br} oifname {br} drop
    iifname {br} ip daddr 169.254.0.0/16 drop
    oifname {br} ct state established,related accept
    oifname {br} drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname {br} ct state established,related accept
    iifname {br} ip daddr {gw} meta l4proto {{ tcp, udp }} th dport {s.dns_port} ct status dnat accept
    iifname {br} ip daddr {gw} tcp dport {s.proxy_port} ct status dnat accept{cache}
    iifname {br} drop
  }}
}}
"""

    async def _ensure_infra(self) -> None:
        s = self.settings
        if self._infra_ready and _link_exists(s.bridge):
            return
        for tool, pkg in (("ip", "iproute2"), ("nft", "nftables"), ("nsenter", "util-linux")):
            if not shutil.which(tool):
                raise Unavailable(f"sandbox networking needs `{tool}`", fix=f"apt-get install {pkg}")
        if not _link_exists(s.bridge):
            await _run("ip", "link", "add", s.bridge, "type", "bridge")
            _write_sysctl(f"net/ipv6/conf/{s.bridge}/disable_ipv6", "1")
            await _run("ip", "-batch", "-", stdin=f"addr add {s.gateway}/{s.network.prefixlen} dev {s.bridge}\n"
                                                 f"link set dev {s.bridge} up\n")
            log.info("created sandbox bridge", extra={"bridge": s.bridge, "subnet": s.subnet})
        _write_sysctl(f"net/ipv4/conf/{s.bridge}/forwarding", "1")
        for dev in await self._uplinks():
            old = _write_sysctl(f"net/ipv4/conf/{dev}/forwarding", "1")
            if old is not None and old != "1" and self._meta(f"forwarding:{dev}") is None:
                self._meta(f"forwarding:{dev}", old)   # restored when the bridge goes away
        self._domain_ips = {r["ip"] for r in self._rows.values()
                            if r["ip"] and (domains_of(r["allows"]) or self.secrets.has(r["sandbox_id"]))}
        self._tunnel_ips = {r["ip"] for r in self._rows.values() if r["ip"] and tunnel_of(r["allows"])}
        await _run("nft", "-f", "-", stdin=self._nft_rules())   # (re)loaded whole: rules of this version
        await self._start_services()
        self._infra_ready = True

    async def _domain_mode(self, ip: str, on: bool) -> None:
        """Add or remove a sandbox address in the set whose TCP 80/443 the egress proxy gets."""
        if on == (ip in self._domain_ips):
            return
        verb = "add" if on else "delete"
        await _run("nft", verb, "element", "inet", self.settings.nft_table, "domain4", f"{{ {ip} }}", check=on)
        (self._domain_ips.add if on else self._domain_ips.discard)(ip)

    async def _tunnel_mode(self, ip: str, on: bool) -> None:
        """Add or remove a sandbox address in the set whose every TCP connection the egress proxy
        gets (NetworkPolicy.egress_proxy: carried through the SOCKS5 proxy, never direct)."""
        if on == (ip in self._tunnel_ips):
            return
        verb = "add" if on else "delete"
        await _run("nft", verb, "element", "inet", self.settings.nft_table, "tunnel4", f"{{ {ip} }}", check=on)
        (self._tunnel_ips.add if on else self._tunnel_ips.discard)(ip)

    async def _start_services(self) -> None:
        """The DNS forwarder and the egress proxy on the gateway, while the bridge exists."""
        s = self.settings
        if self._dns is not None:
            return
        upstream = Upstream(parse_upstream(s.dns_upstream))
        dns = DnsServer(self.view_of_ip, upstream, str(s.gateway), s.dns_port)
        proxy = EgressProxy(self.view_of_ip, upstream, str(s.gateway), s.proxy_port, s.network,
                            Interceptor(self.secrets, self.egress_ca, s.upstream_ca_file))
        try:
            await dns.start()
            await proxy.start()
        except OSError as e:
            await dns.stop()
            await proxy.stop()
            raise Unavailable(f"cannot serve sandbox DNS/egress on {s.gateway} ports {s.dns_port}/{s.proxy_port}: {e}",
                              fix="another dsec on this host uses the same bridge: give each its own "
                                  "DSEC_NET_BRIDGE and DSEC_NET_SUBNET, or set DSEC_NET_DNS_PORT / "
                                  "DSEC_NET_PROXY_PORT to free ports") from e
        self._dns, self._proxy = dns, proxy
        if s.pkgcache_port:
            cache = PackageCache(self.view_of_ip, upstream, str(s.gateway), s.pkgcache_port, s.network,
                                 BlobStore(self.paths.home / "pkgcache", s.pkgcache_max_bytes),
                                 pypi_url=s.pkgcache_pypi_url, npm_url=s.pkgcache_npm_url,
                                 index_ttl_s=s.pkgcache_index_ttl_s, ca_file=s.upstream_ca_file)
            try:
                await cache.start()
            except OSError as e:   # sandboxes keep working without it (pip then fails to reach it)
                cache.store.close()
                log.error("package cache not served", extra={"port": s.pkgcache_port, "error": str(e),
                                                             "fix": "set DSEC_PKGCACHE_PORT to a free port"})
            else:
                self._cache = cache
        log.info("sandbox DNS forwarder and egress proxy serving",
                 extra={"gateway": str(s.gateway), "dns_port": s.dns_port, "proxy_port": s.proxy_port,
                        "upstream": "%s:%d" % upstream.addr})

    async def _stop_services(self) -> None:
        dns, proxy, self._dns, self._proxy = self._dns, self._proxy, None, None
        cache, self._cache = self._cache, None
        if cache is not None:
            await cache.stop()
            cache.store.close()
        if dns is not None:
            await dns.stop()
        if proxy is not None:
            await proxy.stop()

    async def _uplinks(self) -> list[str]:
        _, out = await _run("ip", "-j", "route", "show", "default", check=False)
        try:
            return sorted({r["dev"] for r in json.loads(out or "[]") if r.get("dev") and r["dev"] != self.settings.bridge})
        except (ValueError, TypeError):
            return []

    async def _maybe_teardown(self) -> None:
        """Remove bridge and NAT once no sandbox (of any dsec instance) is plugged in."""
        async with self._infra_lock:
            if any(r["ip"] for r in self._rows.values()) or await self._bridge_ports():
                return
            s = self.settings
            self._infra_ready = False
            await self._stop_services()
            self._domain_ips.clear()
            self._tunnel_ips.clear()
            if _link_exists(s.bridge):
                await _run("ip", "link", "del", s.bridge, check=False)
                log.info("removed sandbox bridge", extra={"bridge": s.bridge})
            if shutil.which("nft"):
                await _run("nft", "delete", "table", "inet", s.nft_table, check=False)
            with self._dblock:
                saved = self._db.execute("SELECT k, v FROM net_meta WHERE k LIKE 'forwarding:%'").fetchall()
            for k, v in saved:
                _write_sysctl(f"net/ipv4/conf/{k.split(':', 1)[1]}/forwarding", v)
                self._meta(k, delete=True)

    def close(self) -> None:
        if self._prog is not None:
            self._prog.close()
        self._db.close()


def _write_if_changed(path: Path, text: str) -> None:
    """A node file sandboxes bind read-only (resolv.conf, apt's proxy): replaced whole (a
    sandbox never reads half a file), world-readable, and not rewritten when it already says it."""
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)
