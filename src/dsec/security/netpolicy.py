"""Per-sandbox egress policy enforced in the kernel by cgroup-BPF (netpolicy.bpf.c).

Three parts:
- `resolve()` turns a user's NetworkPolicy (rules + named rule sets from the operator file
  DSEC_HOME/network-rulesets.json) into a flat allow-list, raising InvalidArgument that names
  the field for anything unknown or out of bounds.
- `compile_allows()` turns an allow-list into LPM-trie entries (network -> port ranges), folding
  into each prefix the ranges of every rule that contains it, so the kernel's longest-prefix
  match alone decides.
- `PolicyProgram` compiles the BPF C with Debian's clang once per source hash, loads it through
  ctypes on Debian's libbpf.so.1, attaches its programs to sandbox cgroups (BPF_F_ALLOW_MULTI,
  no links: an attachment lives exactly as long as the cgroup, so nothing is pinned and nothing
  can outlive a sandbox) and writes the maps. One loaded copy serves every sandbox of an edge;
  entries are keyed by cgroup id.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import hashlib
import ipaddress
import json
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from dsec.types import InvalidArgument, NetworkPolicy, NetworkRule, NetworkRuleSet, Unavailable

log = logging.getLogger("dsec.security.netpolicy")

BPF_SOURCE = Path(__file__).with_name("netpolicy.bpf.c")
RULESETS_FILE = "network-rulesets.json"
MAX_RANGES = 16          # per prefix, as in netpolicy.bpf.c
PROTO_BITS = {"tcp": 1, "udp": 2, "any": 3}
PROTO_DOMAIN = 4         # an Allow whose `cidr` is a domain pattern: served by the node's egress proxy
PROTO_TUNNEL = 8         # an Allow whose `cidr` is a SOCKS5 proxy's host:port (NetworkPolicy.egress_proxy)
ANY4 = "0.0.0.0/0"
DNS_PORT = 53
PROXIED_PORTS = (80, 443)   # TCP ports matched by name (HTTP Host, TLS SNI), as in E2B
PROGRAMS = ("dsec_sock", "dsec_connect4", "dsec_connect6", "dsec_sendmsg4", "dsec_sendmsg6", "dsec_egress")
MAPS = ("dsec_pol4", "dsec_pol6")
PROG_PREFIX = "dsec_"
BPF_F_ALLOW_MULTI = 2


# ---------------------------------------------------------------------------------------
# Policy -> allow-list -> map entries (pure Python, unit-testable without root).
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Allow:
    """One resolved allow rule: destination network, inclusive port range, protocol bits."""

    cidr: str
    lo: int
    hi: int
    protos: int   # 1 tcp, 2 udp, 3 both

    @property
    def is_domain(self) -> bool:
        return bool(self.protos & PROTO_DOMAIN)

    @property
    def is_tunnel(self) -> bool:
        return bool(self.protos & PROTO_TUNNEL)

    def to_json(self) -> list:
        return [self.cidr, self.lo, self.hi, self.protos]

    @classmethod
    def from_json(cls, v: list) -> "Allow":
        return cls(str(v[0]), int(v[1]), int(v[2]), int(v[3]))


def allows_of_rule(rule: NetworkRule) -> list[Allow]:
    bits = PROTO_BITS[rule.protocol]
    return [Allow(rule.cidr, lo, hi, bits) for lo, hi in rule.port_ranges()]


def allows_of_domains(patterns: list[str]) -> list[Allow]:
    return [Allow(p, PROXIED_PORTS[0], PROXIED_PORTS[-1], PROTO_DOMAIN) for p in patterns]


def domains_of(allows: list[Allow]) -> tuple[str, ...]:
    return tuple(a.cidr for a in allows if a.is_domain)


def tunnel_of(allows: list[Allow]) -> str | None:
    """The SOCKS5 proxy (host:port) the sandbox's TCP is carried through, if any. It travels as an
    allow entry so it is wherever the allow-list is (SQLite, the park-to-disk spec, warm claims)
    from the sandbox's first packet: fail-closed without waiting for anything pushed later."""
    return next((a.cidr for a in allows if a.is_tunnel), None)


def egress_allows(allows: list[Allow]) -> list[Allow]:
    """The entries that allow anything (the tunnel entry alone opens nothing)."""
    return [a for a in allows if not a.is_tunnel]


def kernel_allows(allows: list[Allow]) -> list[Allow]:
    """What the BPF maps hold for a policy: its CIDR rules; with any egress at all, UDP and TCP 53
    to any IPv4 address (the node's nftables sends it to the DNS forwarder, whatever the address);
    with domain rules, TCP 80 and 443 to any IPv4 address (sent to the egress proxy, which decides
    by name). IPv6 gets nothing implicit: the bridge does not route it. With an egress proxy
    (tunnel entry) the CIDR rules keep their TCP and IPv4 part only: the SOCKS5 tunnel carries TCP,
    so any other UDP than DNS, or IPv6, would leave beside it (E2B lets it; dsec is fail-closed)."""
    tunnelled = tunnel_of(allows) is not None
    allows = egress_allows(allows)
    out = [a for a in allows if not a.is_domain]
    if tunnelled:
        out = [Allow(a.cidr, a.lo, a.hi, a.protos & PROTO_BITS["tcp"]) for a in out
               if a.protos & PROTO_BITS["tcp"] and _network(a.cidr).version == 4]
    if not allows:
        return out
    out.append(Allow(ANY4, DNS_PORT, DNS_PORT, PROTO_BITS["any"]))
    if any(a.is_domain for a in allows):
        out += [Allow(ANY4, p, p, PROTO_BITS["tcp"]) for p in PROXIED_PORTS]
    return out


class Rulesets:
    """The operator's named rule sets, re-read when the file changes."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: tuple | None = None
        self._sets: dict[str, list[NetworkRule]] = {}
        self._domains: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def get(self) -> dict[str, list[NetworkRule]]:
        with self._lock:
            try:
                st = self.path.stat()
                stamp: tuple | None = (st.st_mtime_ns, st.st_size, st.st_ino)
            except FileNotFoundError:
                stamp = None
            if stamp != self._stamp:
                self._sets, self._domains = self._load() if stamp else ({}, {})
                self._stamp = stamp
            return self._sets

    def write(self, sets: dict[str, NetworkRuleSet]) -> None:
        """Replace the file with the control store's rule sets (pushed by the apiserver): an
        atomic rename, so get() sees the old file or the new one, never half of it."""
        body = {name: rs.model_dump(mode="json", exclude_defaults=True) for name, rs in sorted(sets.items())}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, self.path)

    def domains(self, name: str) -> list[str]:
        """The domain patterns of a rule set ({"pypi": {"domains": ["pypi.org"]}}), as of get()."""
        return self._domains.get(name, [])

    def _load(self) -> tuple[dict[str, list[NetworkRule]], dict[str, list[str]]]:
        try:
            raw = json.loads(self.path.read_text())
            if not isinstance(raw, dict):
                raise ValueError("the top level must be an object {name: {\"rules\": [...]}}")
            out: dict[str, list[NetworkRule]] = {}
            doms: dict[str, list[str]] = {}
            for name, body in raw.items():
                rules = body.get("rules", []) if isinstance(body, dict) else body
                if not isinstance(rules, list):
                    raise ValueError(f"rule set {name!r}: 'rules' must be a list")
                out[name] = [NetworkRule.model_validate(r) for r in rules]
                doms[name] = NetworkPolicy(domains=body.get("domains", []) if isinstance(body, dict) else []).domains
            return out, doms
        except (ValueError, ValidationError, OSError) as e:
            raise Unavailable(f"operator rule-set file {self.path} is invalid: {e}",
                              fix=f"fix {self.path}: {{\"pypi\": {{\"rules\": [{{\"cidr\": \"151.101.0.0/16\", "
                                  f"\"ports\": [443], \"protocol\": \"tcp\"}}]}}}}") from None


def resolve(policy: NetworkPolicy, rulesets: Rulesets, field: str = "network") -> list[Allow]:
    """The flat allow-list of a policy. Unknown rule-set names -> 422 naming the field."""
    prefix = f"{field}." if field else ""
    allows: list[Allow] = []
    for rule in policy.rules:
        allows += allows_of_rule(rule)
    allows += allows_of_domains(policy.domains)
    if policy.egress_proxy is not None:
        allows.append(Allow(policy.egress_proxy.address, 0, 0, PROTO_TUNNEL))
    wanted = [name for name, on in policy.rulesets.items() if on]
    if policy.rulesets:
        known = rulesets.get()
        for name in policy.rulesets:
            if name not in known:
                raise InvalidArgument(
                    f"{prefix}rulesets: unknown rule set {name!r}; known rule sets: "
                    f"{', '.join(sorted(known)) or '(none defined)'}",
                    field=f"{prefix}rulesets.{name}",
                    fix=f"use one of: {', '.join(sorted(known))}" if known else
                    f"the operator defines rule sets in DSEC_HOME/{RULESETS_FILE}")
        for name in wanted:
            for rule in known[name]:
                allows += allows_of_rule(rule)
            allows += allows_of_domains(rulesets.domains(name))
    compile_allows(kernel_allows(allows), field=f"{prefix}rules")   # bounds check now, before anything changes
    return allows


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    net = ipaddress.ip_network(cidr, strict=False)
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96 and \
            net.network_address.ipv4_mapped is not None:
        # ::ffff:a.b.c.d/n is the IPv4 network (the BPF program checks mapped addresses as IPv4)
        net = ipaddress.ip_network(f"{net.network_address.ipv4_mapped}/{net.prefixlen - 96}")
    return net


def compile_allows(allows: list[Allow], field: str = "network.rules"
                   ) -> dict[ipaddress.IPv4Network | ipaddress.IPv6Network, list[tuple[int, int, int]]]:
    """Map entries: each distinct network -> merged (lo, hi, protos) ranges of every rule containing it."""
    nets: dict = collections.defaultdict(list)
    parsed = [(_network(a.cidr), a) for a in allows if not a.is_domain and not a.is_tunnel]
    for net, _ in parsed:
        nets.setdefault(net, [])
    for net in nets:
        per_proto: dict[int, list[tuple[int, int]]] = {1: [], 2: []}
        for outer, a in parsed:
            if outer.version == net.version and (outer == net or net.subnet_of(outer)):  # type: ignore[arg-type]
                for bit in (1, 2):
                    if a.protos & bit:
                        per_proto[bit].append((a.lo, a.hi))
        merged: dict[tuple[int, int], int] = {}
        for bit, ranges in per_proto.items():
            for lo, hi in _merge(ranges):
                merged[(lo, hi)] = merged.get((lo, hi), 0) | bit
        out = sorted((lo, hi, bits) for (lo, hi), bits in merged.items())
        if len(out) > MAX_RANGES:
            raise InvalidArgument(f"{field}: {len(out)} distinct port ranges apply to {net} (at most {MAX_RANGES})",
                                  field=field, fix="merge ports into ranges such as '8000-8100', or split the CIDR")
        nets[net] = out
    return dict(nets)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _key(cgid: int, net) -> tuple[int, bytes]:
    """(map index, key bytes) as laid out in struct key4/key6."""
    return (0 if net.version == 4 else 1,
            struct.pack("<I", 64 + net.prefixlen) + struct.pack("<Q", cgid) + net.network_address.packed)


def _value(ranges: list[tuple[int, int, int]]) -> bytes:
    body = b"".join(struct.pack("<HHI", lo, hi, bits) for lo, hi, bits in ranges)
    return struct.pack("<II", len(ranges), 0) + body + b"\0" * (8 * (MAX_RANGES - len(ranges)))


# ---------------------------------------------------------------------------------------
# Compile (clang, cached by source hash) and load (libbpf through ctypes).
# ---------------------------------------------------------------------------------------


def compile_bpf(source: Path, bin_dir: Path) -> Path:
    """netpolicy.bpf.c -> BPF object, compiled once per source version (like native.py)."""
    clang = shutil.which("clang") or shutil.which("clang-14")
    flags = ["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    out = bin_dir / f"{source.name.split('.')[0]}-{digest}.bpf.o"
    if out.exists():
        return out
    if not clang:
        raise Unavailable("cannot compile the network-policy BPF program: clang is not installed",
                          fix="apt-get install clang libbpf1 (scripts/install.sh does it)")
    bin_dir.mkdir(parents=True, exist_ok=True)
    includes = []
    multiarch = Path("/usr/include") / f"{platform.machine()}-linux-gnu"
    if multiarch.is_dir():   # <asm/types.h> lives here on Debian; -target bpf does not search it
        includes = ["-I", str(multiarch)]
    fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=".netpolicy-", suffix=".o")
    os.close(fd)
    proc = subprocess.run([clang, *flags, *includes, "-c", str(source), "-o", tmp], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise Unavailable(f"cannot compile {source.name}: {proc.stderr.strip()[-1500:]}",
                          fix="install Debian's clang and linux-libc-dev (scripts/install.sh)")
    os.replace(tmp, out)
    log.info("compiled BPF program", extra={"path": str(out)})
    return out


_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class _Libbpf:
    """The few libbpf 1.x calls we need. Low-level calls return -errno on failure."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
        except OSError:
            try:
                lib = ctypes.CDLL(name, use_errno=True)
            except OSError as e:
                raise Unavailable(f"libbpf is not installed: {e}", fix="apt-get install libbpf1") from None
        self.lib = lib
        vp, i, u32, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_char_p
        for fn, res, args in (
            ("bpf_object__open_file", vp, [cp, vp]),
            ("bpf_object__load", i, [vp]),
            ("bpf_object__close", None, [vp]),
            ("bpf_object__find_program_by_name", vp, [vp, cp]),
            ("bpf_object__find_map_fd_by_name", i, [vp, cp]),
            ("bpf_program__fd", i, [vp]),
            ("bpf_program__expected_attach_type", i, [vp]),
            ("bpf_prog_attach", i, [i, i, i, ctypes.c_uint]),
            ("bpf_prog_detach2", i, [i, i, i]),
            ("bpf_prog_query", i, [i, i, u32, ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.POINTER(u32)]),
            ("bpf_prog_get_fd_by_id", i, [u32]),
            ("bpf_map_get_fd_by_id", i, [u32]),
            ("bpf_map_get_next_id", i, [u32, ctypes.POINTER(u32)]),
            ("bpf_obj_get_info_by_fd", i, [i, vp, ctypes.POINTER(u32)]),
            ("bpf_map_update_elem", i, [i, vp, vp, ctypes.c_uint64]),
            ("bpf_map_delete_elem", i, [i, vp]),
            ("bpf_map_get_next_key", i, [i, vp, vp]),
            ("libbpf_set_print", vp, [vp]),
        ):
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
        self.messages: collections.deque[str] = collections.deque(maxlen=60)
        self._printer = None
        if platform.machine() == "x86_64":   # va_list is a pointer there; elsewhere stay silent
            libc = ctypes.CDLL(None)
            vsnprintf = libc.vsnprintf
            vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]

            def _print(level: int, fmt: bytes, va: int) -> int:
                if level <= 1:   # warnings and info, not debug
                    buf = ctypes.create_string_buffer(2048)
                    vsnprintf(buf, len(buf), fmt, va)
                    self.messages.append(buf.value.decode(errors="replace").rstrip())
                return 0
            self._printer = _PRINT_FN(_print)
            lib.libbpf_set_print(ctypes.cast(self._printer, ctypes.c_void_p))
        else:
            lib.libbpf_set_print(None)

    @staticmethod
    def check(ret: int, what: str) -> int:
        if ret < 0:
            raise OSError(-ret, f"{what}: {os.strerror(-ret)}")
        return ret

    def info(self, fd: int, size: int = 256) -> bytes:
        buf = ctypes.create_string_buffer(size)
        n = ctypes.c_uint32(size)
        self.check(self.lib.bpf_obj_get_info_by_fd(fd, buf, ctypes.byref(n)), "bpf_obj_get_info_by_fd")
        return buf.raw

    def prog_id_name(self, fd: int) -> tuple[int, str]:
        raw = self.info(fd)   # struct bpf_prog_info: id at 4, name[16] at 64
        return struct.unpack_from("<I", raw, 4)[0], raw[64:80].split(b"\0")[0].decode()

    def map_id_name(self, fd: int) -> tuple[int, str]:
        raw = self.info(fd)   # struct bpf_map_info: id at 4, name[16] at 24
        return struct.unpack_from("<I", raw, 4)[0], raw[24:40].split(b"\0")[0].decode()

    def keys(self, map_fd: int, key_size: int) -> list[bytes]:
        out: list[bytes] = []
        cur = None
        nxt = ctypes.create_string_buffer(key_size)
        while True:
            ret = self.lib.bpf_map_get_next_key(map_fd, cur, nxt)
            if ret < 0:
                return out
            out.append(nxt.raw)
            cur = ctypes.create_string_buffer(nxt.raw, key_size)


_LIB: _Libbpf | None = None
_LIB_LOCK = threading.Lock()


def libbpf() -> _Libbpf:
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            _LIB = _Libbpf()
        return _LIB


KEY_SIZES = (16, 28)


class PolicyProgram:
    """The loaded BPF object of one edge: attach to sandbox cgroups, write per-cgroup policy."""

    def __init__(self, bin_dir: Path):
        self.lib = libbpf()
        obj_path = compile_bpf(BPF_SOURCE, bin_dir)
        self.lib.messages.clear()
        obj = self.lib.lib.bpf_object__open_file(str(obj_path).encode(), None)
        if not obj:
            raise Unavailable(f"libbpf could not open {obj_path}: {os.strerror(ctypes.get_errno())}; "
                              + " | ".join(self.lib.messages), fix="see the edge log")
        ret = self.lib.lib.bpf_object__load(obj)
        if ret < 0:
            detail = " | ".join(m for m in self.lib.messages if m)[-3000:]
            self.lib.lib.bpf_object__close(obj)
            raise Unavailable(f"the kernel refused the network-policy BPF program ({os.strerror(-ret)}): {detail}",
                              fix="cgroup-BPF needs root (CAP_BPF + CAP_NET_ADMIN) and a kernel with "
                                  "CONFIG_CGROUP_BPF")
        self._obj = obj
        self.progs: dict[str, tuple[int, int, int]] = {}   # name -> (fd, attach type, prog id)
        for name in PROGRAMS:
            p = self.lib.lib.bpf_object__find_program_by_name(obj, name.encode())
            fd = self.lib.lib.bpf_program__fd(p)
            self.progs[name] = (fd, self.lib.lib.bpf_program__expected_attach_type(p), self.lib.prog_id_name(fd)[0])
        self.maps = [self.lib.check(self.lib.lib.bpf_object__find_map_fd_by_name(obj, m.encode()), m) for m in MAPS]
        self.map_ids = [self.lib.map_id_name(fd)[0] for fd in self.maps]
        self._entries: dict[int, set[tuple[int, bytes]]] = {}   # cgid -> keys written
        self._lock = threading.Lock()
        log.info("network-policy BPF program loaded",
                 extra={"object": str(obj_path), "prog_ids": [p[2] for p in self.progs.values()]})

    # -- attachment ------------------------------------------------------------------------
    def attach(self, cgroup_dir: Path, *, fresh: bool = False) -> int:
        """Attach every program to the cgroup; returns its cgroup id. Unless `fresh`, programs of
        another generation (an earlier edge process or source version) are detached afterwards,
        so exactly this copy decides."""
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            cgid = os.fstat(fd).st_ino
            for name, (pfd, atype, pid) in self.progs.items():
                attached = set() if fresh else self._attached(fd, atype)
                if pid not in attached:
                    self.lib.check(self.lib.lib.bpf_prog_attach(pfd, fd, atype, BPF_F_ALLOW_MULTI),
                                   f"attach {name} to {cgroup_dir}")
                for other in attached - {pid}:
                    self._detach_foreign(fd, atype, other)
            return cgid
        finally:
            os.close(fd)

    def _attached(self, cg_fd: int, atype: int) -> set[int]:
        ids = (ctypes.c_uint32 * 64)()
        cnt = ctypes.c_uint32(64)
        flags = ctypes.c_uint32(0)
        self.lib.check(self.lib.lib.bpf_prog_query(cg_fd, atype, 0, ctypes.byref(flags), ids, ctypes.byref(cnt)),
                       "bpf_prog_query")
        return set(ids[: cnt.value])

    def _detach_foreign(self, cg_fd: int, atype: int, prog_id: int) -> None:
        pfd = self.lib.lib.bpf_prog_get_fd_by_id(prog_id)
        if pfd < 0:
            return
        try:
            if self.lib.prog_id_name(pfd)[1].startswith(PROG_PREFIX):
                self.lib.lib.bpf_prog_detach2(pfd, cg_fd, atype)
        finally:
            os.close(pfd)

    # -- policy ------------------------------------------------------------------------------
    def write(self, cgid: int, allows: list[Allow]) -> None:
        """Replace the cgroup's policy: new entries first, then stale ones are removed."""
        entries = {_key(cgid, net): _value(ranges) for net, ranges in compile_allows(kernel_allows(allows)).items()}
        with self._lock:
            old = self._entries.get(cgid, set())
            for (m, k), v in entries.items():
                self.lib.check(self.lib.lib.bpf_map_update_elem(self.maps[m], k, v, 0), "bpf_map_update_elem")
            for m, k in old - set(entries):
                self.lib.lib.bpf_map_delete_elem(self.maps[m], k)
            if entries:
                self._entries[cgid] = set(entries)
            else:
                self._entries.pop(cgid, None)

    def clear(self, cgid: int) -> None:
        self.write(cgid, [])

    def entry_count(self) -> int:
        return sum(len(self.lib.keys(fd, ks)) for fd, ks in zip(self.maps, KEY_SIZES))

    def close(self) -> None:
        """Drop this process's handles; attached programs keep enforcing (they hold the maps)."""
        if self._obj:
            self.lib.lib.bpf_object__close(self._obj)
            self._obj = None


# ---------------------------------------------------------------------------------------
# Introspection used by tests and `leak` checks: what dsec BPF state exists on the host.
# ---------------------------------------------------------------------------------------


def policy_entries_for(cgid: int) -> int:
    """How many policy entries any dsec policy map on this host holds for a cgroup id."""
    lib = libbpf()
    n = 0
    cur = ctypes.c_uint32(0)
    nxt = ctypes.c_uint32(0)
    while lib.lib.bpf_map_get_next_id(cur.value, ctypes.byref(nxt)) == 0:
        cur.value = nxt.value
        fd = lib.lib.bpf_map_get_fd_by_id(nxt.value)
        if fd < 0:
            continue
        try:
            _, name = lib.map_id_name(fd)
            if name in MAPS:
                ks = KEY_SIZES[MAPS.index(name)]
                want = struct.pack("<Q", cgid)
                n += sum(1 for k in lib.keys(fd, ks) if k[4:12] == want)
        finally:
            os.close(fd)
    return n


def attached_programs(cgroup_dir: Path) -> list[str]:
    """Names of the dsec programs attached to a cgroup directory (any generation)."""
    lib = libbpf()
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    names = []
    try:
        for atype in (0, 1, 2, 10, 11, 14, 15):   # ingress, egress, sock_create, connect4/6, sendmsg4/6
            ids = (ctypes.c_uint32 * 64)()
            cnt = ctypes.c_uint32(64)
            flags = ctypes.c_uint32(0)
            if lib.lib.bpf_prog_query(fd, atype, 0, ctypes.byref(flags), ids, ctypes.byref(cnt)) < 0:
                continue
            for pid in ids[: cnt.value]:
                pfd = lib.lib.bpf_prog_get_fd_by_id(pid)
                if pfd >= 0:
                    try:
                        name = lib.prog_id_name(pfd)[1]
                        if name.startswith(PROG_PREFIX):
                            names.append(name)
                    finally:
                        os.close(pfd)
    finally:
        os.close(fd)
    return sorted(names)
