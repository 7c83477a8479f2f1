"""E2B sandbox <-> dsec sandbox: create arguments in, sandbox info out.

What dsec cannot honour is refused by name (Unsupported, a 400); see docs/e2b.md for the table.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import TypeAdapter, ValidationError

from dsec.apiserver.e2b.auth import AccessTokens
from dsec.apiserver.e2b.errors import Unsupported
from dsec.apiserver.e2b.ids import to_e2b
from dsec.apiserver.e2b.models import NewSandbox
from dsec.types.domains import normalize_name, pattern_error
from dsec.types import (E2B_INLINE_MARK, EgressSecret, IDEMPOTENCY_KEY_RE, MAX_TTL_S, RULESET_NAME_RE, SNAPSHOT_ID_PATTERN,
                        VM_BACKENDS, InvalidArgument, SandboxArgs, SandboxInfo,
                        SandboxState, UsageSample)

# What the SDK gates on envd's version (e2b/envd/versions.py): commands stdin (0.3.0), default
# user (0.4.0), close stdin (0.5.2), octet-stream upload (0.5.7), file metadata (0.6.2, refused
# by name here), watch options (0.6.x, WatchDir is unimplemented). 0.6.4 lets every call reach
# dsec, which then serves it or refuses it by name.
ENVD_VERSION = "0.6.4"
# E2B's layout: the default user `user` (uid 1000) with home /home/user, the cwd and HOME of
# commands and the code interpreter: the workdir of every sandbox created here (the agent makes
# it, owned by uid 1000); layout.py adds the passwd/group entries
E2B_HOME = "/home/user"
# what the agent's default environment names `sandbox`, for the default user of E2B's commands
# (getpass.getuser() reads these before the passwd entry)
E2B_USER_ENV = {"USER": "user", "LOGNAME": "user"}
DEFAULT_TIMEOUT_S = 300       # the SDK's documented default sandbox timeout (SandboxBase)
DSEC_KEYS = {"dsec.backend": "backend", "dsec.cpu_cores": "cpu_cores", "dsec.memory_mb": "memory_mb"}
ALL_TRAFFIC = ("0.0.0.0/0", "::/0")
_ARGS = TypeAdapter(SandboxArgs)
# dsec field -> the E2B field a user wrote it as (for error messages)
_E2B_FIELD = {"image": "templateID", "volumes": "volumeMounts", "lifetime_s": "timeout", "labels": "metadata", "env": "envVars",
              "network": "network", "cpu_cores": "metadata.dsec.cpu_cores", "vcpus": "metadata.dsec.cpu_cores",
              "memory_mb": "metadata.dsec.memory_mb", "backend": "metadata.dsec.backend"}


def _refuse(field: str, why: str, fix: str) -> Unsupported:
    return Unsupported(f"{field}: {why}", field=field, fix=fix)


def _check_unsupported(body: NewSandbox, backend: str) -> None:
    """Every field dsec cannot honour, by name."""
    if body.auto_pause_memory is not None and not body.auto_pause:
        raise _refuse("autoPauseMemory", "it only applies with lifecycle.on_timeout 'pause'",
                      "set lifecycle.on_timeout to 'pause', or leave its mode unset")
    if body.auto_resume is not None and body.auto_resume.get("enabled") is False and body.auto_pause:
        raise _refuse("autoResume.enabled", "a paused dsec sandbox always resumes on its next request "
                                            "(native, envd or port traffic)", "leave lifecycle.auto_resume unset or True")
    if body.secure is False:
        raise _refuse("secure", "envd access in dsec always needs the sandbox's access token",
                      "leave secure unset")
    for name, value in (("mcp", body.mcp), ("iam", body.iam)):
        if value:
            raise _refuse(name, "not available in dsec", f"leave {name} unset")
    for key in ("rules", "egressProxy"):   # both need the node to act for the guest's TLS/TCP: containers only
        if backend in VM_BACKENDS and (body.network or {}).get(key):
            raise _refuse(f"network.{key}", "dsec VMs cannot have header rules or an egress proxy yet",
                          "use a container sandbox (the default) for these, or leave it unset")


def _cidr(value: str, field: str) -> str:
    try:
        return str(ipaddress.ip_network(value.strip(), strict=False))
    except ValueError:
        raise _refuse(field, f"{value[:80]!r} is not an IP address or CIDR block", "list IP addresses or CIDR "
                             "blocks (domain names are allowed in allowOut only)") from None


def _destination(value: str, field: str) -> tuple[str, str]:
    """An allowOut entry: ('cidr', network) or ('domain', pattern), as E2B reads them, or
    dsec's ('ruleset', name) for '@name': an operator's named rule set."""
    if not isinstance(value, str):
        raise _refuse(field, f"{value!r} is not a string", "list CIDR blocks, IP addresses or domain names")
    if value.startswith("@"):
        if not re.match(RULESET_NAME_RE, value[1:]):
            raise _refuse(field, f"{value[:80]!r} is not a rule set name", "use '@' and a name from `dsec ruleset ls`")
        return "ruleset", value[1:]
    try:
        return "cidr", str(ipaddress.ip_network(value.strip(), strict=False))
    except ValueError:
        err = pattern_error(value)
        if err:
            raise _refuse(field, err, "list CIDR blocks ('10.0.0.0/8'), IP addresses or domain names "
                                      "('pypi.org', '*.githubusercontent.com')") from None
        return "domain", normalize_name(value)


# Keys of E2B's network object dsec reads; dnsServers is accepted and has no effect (every
# sandbox's port 53 goes to dsec's forwarder whatever the address, docs/e2b.md)
_NETWORK_KEYS = {"allowOut", "denyOut", "allowPublicTraffic", "dnsServers"}


def transform_rules(net: dict[str, Any] | None, prefix: str = "network") -> list[EgressSecret]:
    """E2B's `rules` ({host: [{transform: {headers: {...}}}]}) as secret rules of this sandbox
    only: the node's egress proxy adds the headers on TLS to the host (issue 30). As in E2B, a
    host must also be reachable by allowOut; dsec matches hosts by name (TLS SNI)."""
    raw = (net or {}).get("rules") or {}
    if not isinstance(raw, dict):
        raise _refuse(f"{prefix}.rules", "must map a host to a list of rules", "see E2B's SandboxNetworkOpts.rules")
    out = []
    for host, rules in raw.items():
        field = f"{prefix}.rules.{host}"
        try:
            ipaddress.ip_network(host, strict=False)
            raise _refuse(field, "dsec adds headers by destination name (the TLS server name), not by address",
                          "key the rule by the host name the sandbox connects to")
        except ValueError:
            pass
        headers: dict[str, str] = {}
        for rule in rules if isinstance(rules, list) else [None]:
            if not isinstance(rule, dict) or set(rule) - {"transform"}:
                raise _refuse(field, "a rule is {\"transform\": {\"headers\": {...}}} in dsec",
                              "use transform.headers only")
            transform = rule.get("transform") or {}
            if set(transform) - {"headers"}:
                raise _refuse(f"{field}.transform", "only headers are transformed in dsec", "use transform.headers")
            for k, v in (transform.get("headers") or {}).items():
                if isinstance(v, str) and "${e2b." in v:
                    raise _refuse(f"{field}.transform.headers.{k}", "dsec has no workload identity tokens",
                                  "put the credential itself in the header value (it never enters the sandbox)")
                headers[k] = v
        if headers:
            out.append({"id": "e2b", "hosts": [host], "headers": headers, "kind": "inline"})
    try:
        return [EgressSecret.model_validate(r) for r in out]
    except ValidationError as e:
        raise _invalid(e) from None


def _egress_proxy(raw: Any, field: str, keep_password: bool) -> dict[str, Any] | None:
    """E2B's egressProxy ({address, username?, password?, tls?}) as NetworkPolicy.egress_proxy.
    The password is taken at create only (the edge keeps it in memory; an update keeps the
    sandbox's tunnel and credentials, dsec's proxy being set at create)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("address"), str):
        raise _refuse(field, "must be {\"address\": \"host:port\", ...}", "give the SOCKS5 server's host:port")
    if raw.get("tls"):
        raise _refuse(f"{field}.tls", "dsec speaks SOCKS5 to the proxy without TLS", "leave tls unset")
    extra = sorted(set(raw) - {"address", "username", "password", "tls"})
    if extra:
        raise _refuse(f"{field}.{extra[0]}", "not available in dsec", "give address, username and password only")
    out = {"address": raw["address"], "username": raw.get("username"),
           "password": raw.get("password") if keep_password else None}
    return {k: v for k, v in out.items() if v is not None}


def check_kept_proxy(raw: dict[str, Any] | None, current: Any) -> None:
    """PUT .../network: dsec's egress proxy is set at create and kept for the sandbox's life (an
    update that omits it keeps tunnelling: never direct); naming another one is refused."""
    want = ((raw or {}).get("egress_proxy") or {}).get("address")
    have = getattr(getattr(current, "egress_proxy", None), "address", None)
    if want is not None and want.lower() != have:
        raise _refuse("network.egressProxy", "dsec sets a sandbox's egress proxy when it is created only" +
                      (f" (this one tunnels through {have})" if have else ""),
                      f"repeat {have!r} or leave egressProxy unset" if have else
                      "create a new sandbox with the egress proxy")


def network_policy(net: dict[str, Any] | None, internet: bool | None, prefix: str = "network",
                   rules_ok: bool = False) -> dict[str, Any] | None:
    """dsec's egress policy (deny-all by default) from E2B's allow_internet_access and network
    (create) or allowInternetAccess and the rest of the body (PUT /sandboxes/{id}/network).
    E2B's semantics: allowOut wins over denyOut; domains only in allowOut, matched on TCP 80/443.
    `rules` (header transforms) are read by transform_rules, at create only."""
    net = dict(net or {})
    proxy = _egress_proxy(net.pop("egressProxy", None), f"{prefix}.egressProxy", keep_password=rules_ok)
    if net.get("rules") and not rules_ok:
        raise _refuse(f"{prefix}.rules", "dsec sets header transforms when the sandbox is created only",
                      "create a new sandbox with the rules")
    net.pop("rules", None)
    allow = [_destination(v, f"{prefix}.allowOut") for v in net.pop("allowOut", None) or []]
    deny = [_cidr(v, f"{prefix}.denyOut") for v in net.pop("denyOut", None) or []]
    if net.pop("allowPublicTraffic", None) is True:
        raise _refuse(f"{prefix}.allowPublicTraffic", "dsec never serves a sandbox's ports without a key or the "
                                                      "sandbox's access token", "leave it unset or false")
    net.pop("dnsServers", None)
    extra = sorted(k for k, v in net.items() if v is not None)
    if extra:
        raise _refuse(f"{prefix}.{extra[0]}", "not available in dsec",
                      "use allowOut (CIDRs, IPs, domain names) and denyOut (0.0.0.0/0)")
    if deny and not set(deny) <= set(ALL_TRAFFIC):
        raise _refuse(f"{prefix}.denyOut", "dsec's egress policy is an allow-list: it cannot deny parts of what "
                                           "it allows", "deny all (0.0.0.0/0) and allow what is needed in allowOut")
    cidrs = [v for kind, v in allow if kind == "cidr"]
    domains = [v for kind, v in allow if kind == "domain"]
    rulesets = {v: True for kind, v in allow if kind == "ruleset"}
    if internet and not deny and not allow:
        cidrs = list(ALL_TRAFFIC)
    if not cidrs and not domains and not rulesets and proxy is None:
        return None                    # dsec's default: no egress but loopback
    out: dict[str, Any] = {"rules": [{"cidr": c} for c in cidrs], "domains": domains}
    if proxy is not None:
        out["egress_proxy"] = proxy
    if rulesets:
        out["rulesets"] = rulesets
    return out


def _network(body: NewSandbox, internet_default: bool) -> dict[str, Any] | None:
    """E2B's default is the internet on: a create naming neither gets it where the project's
    policy allows it (internet_default, iam.policy.default_internet), else no egress."""
    internet = body.allow_internet_access
    if internet is None and not body.network:
        internet = internet_default
    return network_policy(body.network, internet, rules_ok=True)


def _dsec_metadata(metadata: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Split metadata into labels and dsec's own keys (dsec.backend, dsec.cpu_cores, dsec.memory_mb)."""
    labels, own = {}, {}
    for k, v in metadata.items():
        if k in DSEC_KEYS:
            own[DSEC_KEYS[k]] = v
        elif k.startswith("dsec."):
            raise InvalidArgument(f"metadata key {k!r} is not one dsec reads", field=f"metadata.{k}",
                                  fix="dsec's own keys: " + ", ".join(DSEC_KEYS))
        else:
            labels[k] = v
    return labels, own


def idempotency_key(header: str | None) -> str | None:
    """E2B's Idempotency-Key (up to 255 chars) as dsec's (up to 128): long ones are hashed."""
    if not header:
        return None
    if re.match(IDEMPOTENCY_KEY_RE, header):
        return header
    return "e2b-" + hashlib.sha256(header.encode()).hexdigest()[:64]


# E2B's SDKs create from these templates when none is named: the dsec images that play them.
TEMPLATE_ALIASES = {"base": "e2b-base", "code-interpreter-v1": "code-interpreter"}


def sandbox_args(body: NewSandbox, idem: str | None, internet_default: bool = False) -> Any:
    """The dsec SandboxArgs of an E2B create request. `internet_default`: whether a create that
    names no network gets the internet (E2B's default), as the project's policy allows."""
    labels, own = _dsec_metadata(body.metadata or {})
    backend = own.pop("backend", "container")
    _check_unsupported(body, backend)
    timeout = body.timeout if body.timeout is not None else DEFAULT_TIMEOUT_S
    raw: dict[str, Any] = {
        "backend": backend, "image": TEMPLATE_ALIASES.get(body.template_id, body.template_id), "lifetime_s": timeout, "ttl_idle_s": MAX_TTL_S,
        "labels": labels, "env": body.env_vars or {}, "idempotency_key": idempotency_key(idem),
        "workdir": E2B_HOME, "on_timeout": "pause" if body.auto_pause else "stop"}
    if body.volume_mounts:      # [{name, path}]: E2B mounts read-write
        raw["volumes"] = [{"name": m.get("name"), "path": m.get("path")} for m in body.volume_mounts]
    net = _network(body, internet_default)
    if backend in VM_BACKENDS:
        if "cpu_cores" in own:
            raw["vcpus"] = own.pop("cpu_cores")
        # always a NIC (E2B's update_network may open it later); a VM restored from a snapshot
        # has the snapshot's devices, so there only what the user named
        if not re.match(SNAPSHOT_ID_PATTERN, body.template_id) or body.network or body.allow_internet_access:
            raw["network"] = net or {}
    else:
        if net is not None:
            raw["network"] = net
        if (body.network or {}).get("rules"):
            raw["secrets"] = [E2B_INLINE_MARK]   # the rules themselves: transform_rules, to the edge only
    raw.update(own)
    if re.match(SNAPSHOT_ID_PATTERN, body.template_id):   # create_snapshot's id: a sandbox made from it
        raw["snapshot"] = body.template_id
    try:
        return _ARGS.validate_python(raw)
    except ValidationError as e:
        raise _invalid(e) from None


def _invalid(e: ValidationError) -> InvalidArgument:
    first = e.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if str(p) not in ("container", "microvm", "vm")]
    name = _E2B_FIELD.get(loc[0], loc[0]) if loc else "body"
    field = ".".join([name, *loc[1:]]) if loc else name
    if loc and loc[0] == "backend":
        return InvalidArgument(f"metadata dsec.backend: {first.get('msg')}", field=field,
                               fix="use 'container', 'microvm' or 'vm'")
    return InvalidArgument(f"{field}: {first.get('msg', 'invalid')}", field=field,
                           fix="see docs/e2b.md for what dsec accepts")


# -- sandbox info out -------------------------------------------------------------------------

def e2b_state(info: SandboxInfo) -> str | None:
    """E2B's state of a sandbox; None: it has ended (E2B no longer knows it)."""
    if info.state in (SandboxState.running, SandboxState.creating):
        return "running"
    if info.state == SandboxState.suspended:
        return "paused"
    return None


def end_at(info: SandboxInfo) -> datetime:
    if info.expires_at is not None:
        return info.expires_at
    return info.last_active_at + timedelta(seconds=info.ttl_idle_s)


def created(info: SandboxInfo, tokens: AccessTokens, domain: str | None = None) -> dict[str, Any]:
    """E2B's Sandbox (create/connect answers)."""
    return {"templateID": info.image, "sandboxID": to_e2b(info.id), "clientID": info.node,
            "envdVersion": ENVD_VERSION, "envdAccessToken": tokens.token(info.id),
            "trafficAccessToken": tokens.traffic_token(info.id), "domain": domain}


def listed(info: SandboxInfo) -> dict[str, Any]:
    """E2B's ListedSandbox."""
    return {"templateID": info.image, "sandboxID": to_e2b(info.id), "clientID": info.node,
            "startedAt": info.created_at.isoformat(), "endAt": end_at(info).isoformat(),
            "cpuCount": max(1, math.ceil(info.cpu_cores)), "memoryMB": info.memory_mb,
            "diskSizeMB": 0,   # not in dsec's SandboxInfo (the quota is disk_mb of the args)
            "state": e2b_state(info) or "running", "envdVersion": ENVD_VERSION, "metadata": dict(info.labels),
            "volumeMounts": [{"name": m.name, "path": m.path} for m in info.volumes]}


def detail(info: SandboxInfo, tokens: AccessTokens, domain: str | None = None) -> dict[str, Any]:
    """E2B's SandboxDetail (GET /sandboxes/{id})."""
    out = listed(info)
    egress = bool(info.network and (info.network.rules or info.network.domains or any(info.network.rulesets.values())))
    out.update({"envdAccessToken": tokens.token(info.id), "domain": domain,
                "allowInternetAccess": egress,
                # a paused dsec sandbox resumes on its next request whatever its on_timeout
                "lifecycle": {"onTimeout": "pause" if info.on_timeout == "pause" else "kill", "autoResume": True}})
    return out


def metric(s: UsageSample) -> dict[str, Any]:
    """A usage sample as E2B's SandboxMetric (GET /sandboxes/{id}/metrics)."""
    return {"timestamp": datetime.fromtimestamp(s.timestamp, timezone.utc).isoformat().replace("+00:00", "Z"),
            "timestampUnix": int(s.timestamp), "cpuCount": s.cpu_count, "cpuUsedPct": s.cpu_used_pct,
            "memUsed": s.mem_used, "memTotal": s.mem_total, "memCache": s.mem_cache,
            "diskUsed": s.disk_used, "diskTotal": s.disk_total}
