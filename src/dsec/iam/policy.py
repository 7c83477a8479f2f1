"""Project sandbox policy: what a project's sandboxes may loosen, inherited down the tree.

Every defence is on by default; a sandbox's arguments can loosen some (network egress, larger
limits, running as root). A project policy bounds how far. The policy that applies to a
project is the intersection of its own and every ancestor's ("effective" policy), so a child
project can only narrow what its parent allows, never widen it: setting a child's policy wider
than its parent's effective one is refused, and narrowing a parent later narrows every child at
once (nothing is copied).

A field left out (None) adds no restriction of its own. There is no option to disable Landlock,
seccomp or the user namespace at all (not even for the root project), so the policy has no
field for them.

Enforced by the apiserver on create and on set_network (apiserver/control.py); errors are 403
`forbidden` naming the offending field and the most the project allows.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.types import RULESET_NAME_RE, Forbidden, NetworkPolicy

# policy field -> sandbox argument it bounds (numbers: the argument must be <= the bound)
LIMITS = {"max_cpu_cores": "cpu_cores", "max_memory_mb": "memory_mb", "max_disk_mb": "disk_mb",
          "max_pids_limit": "pids_limit", "max_nofile": "nofile", "max_output_cap_bytes": "output_cap_bytes",
          "max_output_total_bytes": "output_total_bytes"}
# the egress ceiling, narrowest first: none (no egress at all), rulesets (only the operator's
# named rule sets), internet (rules, domains and rule sets, as `cidrs`/`rulesets` bound them)
EGRESS_LEVELS = ("none", "rulesets", "internet")
Egress = Literal["none", "rulesets", "internet"]
INTERNET = ("0.0.0.0/0", "::/0")
# bounds on how fast a project creates (apiserver/fair_creates.py), narrowed down the tree like LIMITS
RATES = ("max_creates_per_s", "max_create_burst")


class SandboxPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    egress: Annotated[Egress | None, Field(
        description="the project's egress, a ceiling no create can lift and the E2B mount's default: 'none' "
                    "(no egress, no DNS), 'rulesets' (only the operator's named rule sets), 'internet' (any "
                    "rules within `cidrs`; E2B creates that name no network get the internet, as on E2B); "
                    "None: as 'internet'")] = None
    rulesets: Annotated[list[Annotated[str, Field(pattern=RULESET_NAME_RE)]] | None,
                        Field(description="named network rule sets sandboxes may turn on; None: any; []: none")] = None
    cidrs: Annotated[list[str] | None,
                     Field(description="networks that explicit egress rules must lie within; None: any; "
                                       "[]: no explicit rules")] = None
    allow_root: bool | None = Field(None, description="False: sandboxes and commands may not run as user 'root'")
    max_cpu_cores: Annotated[float | None, Field(gt=0)] = None
    max_memory_mb: Annotated[int | None, Field(ge=1)] = None
    max_disk_mb: Annotated[int | None, Field(ge=1)] = None
    max_pids_limit: Annotated[int | None, Field(ge=1)] = None
    max_nofile: Annotated[int | None, Field(ge=1)] = None
    max_output_cap_bytes: Annotated[int | None, Field(ge=1)] = None
    max_output_total_bytes: Annotated[int | None, Field(ge=1)] = None
    max_creates_per_s: float | None = Field(None, gt=0, description="sandbox creates per second (per apiserver); "
                                                                     "beyond: 429 with Retry-After")
    max_create_burst: int | None = Field(None, ge=1, description="creates at once above max_creates_per_s "
                                                                 "(default: one second's worth)")

    @field_validator("cidrs")
    @classmethod
    def _valid_cidrs(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        try:
            return [str(ipaddress.ip_network(c.strip(), strict=False)) for c in v]
        except ValueError as e:
            raise ValueError(f"cidrs: {e}; use e.g. '10.0.0.0/8'") from None


class EffectivePolicy(BaseModel):
    """GET /v1/projects/{id}/policy: the project's own policy and the one that applies."""

    project_id: str
    own: SandboxPolicy
    effective: SandboxPolicy


def _within(net: str, allowed: list[str]) -> bool:
    n = ipaddress.ip_network(net, strict=False)
    return any(n.version == a.version and n.subnet_of(a)   # type: ignore[arg-type]
               for a in (ipaddress.ip_network(x) for x in allowed))


def narrow(parent: SandboxPolicy, child: SandboxPolicy) -> SandboxPolicy:
    """The intersection: what both allow."""
    out: dict = {}
    levels = [EGRESS_LEVELS.index(v) for v in (parent.egress, child.egress) if v is not None]
    out["egress"] = EGRESS_LEVELS[min(levels)] if levels else None
    out["rulesets"] = (child.rulesets if parent.rulesets is None else parent.rulesets if child.rulesets is None
                       else [r for r in child.rulesets if r in parent.rulesets])
    out["cidrs"] = (child.cidrs if parent.cidrs is None else parent.cidrs if child.cidrs is None
                    else [c for c in child.cidrs if _within(c, parent.cidrs)])
    out["allow_root"] = None if parent.allow_root is None and child.allow_root is None else \
        bool((parent.allow_root is not False) and (child.allow_root is not False))
    for f in (*LIMITS, *RATES):
        vals = [v for v in (getattr(parent, f), getattr(child, f)) if v is not None]
        out[f] = min(vals) if vals else None
    return SandboxPolicy(**out)


def check_narrows(parent: SandboxPolicy, child: SandboxPolicy) -> None:
    """Refuse a child policy that allows more than its parent's effective policy."""
    fix = "a project may only narrow its parent's policy: ask for at most what the parent allows"
    if child.egress is not None and EGRESS_LEVELS.index(child.egress) > EGRESS_LEVELS.index(parent.egress or "internet"):
        raise Forbidden(f"egress={child.egress!r} is wider than the parent project's egress={parent.egress!r}",
                        field="egress", fix=fix)
    if child.rulesets is not None and parent.rulesets is not None:
        extra = [r for r in child.rulesets if r not in parent.rulesets]
        if extra:
            raise Forbidden(f"rule sets {extra} are not allowed by the parent project (it allows {parent.rulesets})",
                            field="rulesets", fix=fix)
    if child.cidrs is not None and parent.cidrs is not None:
        extra = [c for c in child.cidrs if not _within(c, parent.cidrs)]
        if extra:
            raise Forbidden(f"networks {extra} lie outside the parent project's {parent.cidrs}", field="cidrs", fix=fix)
    if child.allow_root and parent.allow_root is False:
        raise Forbidden("allow_root=true but the parent project forbids root", field="allow_root", fix=fix)
    for f in (*LIMITS, *RATES):
        c, p = getattr(child, f), getattr(parent, f)
        if c is not None and p is not None and c > p:
            raise Forbidden(f"{f}={c} exceeds the parent project's {p}", field=f, fix=fix)


def _fix(project_id: str, what: str) -> str:
    return (f"{what}, or ask an admin of a parent project to allow it "
            f"(PUT /v1/projects/{project_id}/policy, `dsec project policy-set`)")


def check_network(policy: SandboxPolicy, net: NetworkPolicy, project_id: str, prefix: str = "network.") -> None:
    _check_egress(policy, net, project_id, prefix)
    if net.egress_proxy is not None and (policy.cidrs is not None or policy.egress not in (None, "internet")):
        # the SOCKS server sees every byte: a project held to some networks cannot name any server
        raise Forbidden(f"project {project_id} restricts egress; an egress proxy at {net.egress_proxy.address!r} "
                        "would receive the sandbox's traffic", field=f"{prefix}egress_proxy",
                        fix=_fix(project_id, "leave egress_proxy unset"))
    if net.domains and policy.cidrs is not None:
        # a name may resolve anywhere: a project held to some networks cannot allow names
        raise Forbidden(f"project {project_id} allows egress only to {policy.cidrs or 'no networks'}; "
                        f"domain rules ({net.domains[0]!r}) could reach any address",
                        field=f"{prefix}domains", fix=_fix(project_id, "leave domains empty"))
    for name, on in net.rulesets.items():
        if on and policy.rulesets is not None and name not in policy.rulesets:
            raise Forbidden(f"project {project_id} does not allow network rule set {name!r}",
                            field=f"{prefix}rulesets.{name}",
                            fix=_fix(project_id, f"use only rule sets {policy.rulesets}"))
    for i, rule in enumerate(net.rules):
        if policy.cidrs is not None and not _within(rule.cidr, policy.cidrs):
            raise Forbidden(f"project {project_id} does not allow egress to {rule.cidr}",
                            field=f"{prefix}rules.{i}.cidr",
                            fix=_fix(project_id, f"allow only networks within {policy.cidrs}" if policy.cidrs
                                     else "this project allows no explicit egress rules"))


def _check_egress(policy: SandboxPolicy, net: NetworkPolicy, project_id: str, prefix: str) -> None:
    """The project's egress ceiling: 'none' refuses any egress, 'rulesets' anything but rule sets."""
    if policy.egress is None or policy.egress == "internet":
        return
    wants = [(f"{prefix}rules.0.cidr", net.rules[0].cidr)] if net.rules else []
    wants += [(f"{prefix}domains", net.domains[0])] if net.domains else []
    on = [name for name, v in net.rulesets.items() if v]
    if policy.egress == "none" and on:
        wants.append((f"{prefix}rulesets.{on[0]}", on[0]))
    if wants:
        field, what = wants[0]
        allowed = "no egress at all" if policy.egress == "none" else "egress only through the operator's rule sets"
        raise Forbidden(f"project {project_id}'s policy has egress={policy.egress!r} ({allowed}); "
                        f"{field}={what!r} asks for more", field=field,
                        fix=_fix(project_id, "leave network unset" if policy.egress == "none"
                                 else "use only network.rulesets (`dsec ruleset ls`)"))


def default_internet(policy: SandboxPolicy) -> bool:
    """Whether a sandbox that names no network gets the internet where the API's default is E2B's
    (allow_internet_access unset): only where the ceiling allows any address."""
    if policy.egress not in (None, "internet"):
        return False
    return policy.cidrs is None or all(_within(c, policy.cidrs) for c in INTERNET)


def is_root(user: str | None) -> bool:
    """'root', '0' or '0:GID' (any group): uid 0 inside the sandbox."""
    if user is None:
        return False
    uid = user.partition(":")[0]
    return user == "root" or (uid.isdigit() and int(uid) == 0)   # "00" is uid 0 too


def check_root(policy: SandboxPolicy, user: str | None, project_id: str, what: str = "sandboxes running") -> None:
    """Refuse acting as root (a sandbox, a command, a file call) where the policy forbids it."""
    if policy.allow_root is False and is_root(user):
        raise Forbidden(f"project {project_id} does not allow {what} as root (its policy has allow_root=false)",
                        field="user", fix=_fix(project_id, "leave user unset (uid 1000)"))


def check_create(policy: SandboxPolicy, args: object, project_id: str) -> None:
    """Refuse sandbox arguments beyond the project's effective policy (403 naming the field)."""
    for f, arg in LIMITS.items():
        bound, value = getattr(policy, f), getattr(args, arg, None)
        if bound is not None and value is not None and value > bound:
            raise Forbidden(f"{arg}={value} exceeds project {project_id}'s {f}={bound}", field=arg,
                            fix=_fix(project_id, f"ask for at most {arg}={bound}"))
    check_root(policy, getattr(args, "user", None), project_id)
    net = getattr(args, "network", None)
    if isinstance(net, NetworkPolicy):
        check_network(policy, net, project_id)
