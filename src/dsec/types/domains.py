"""Egress rules by domain name: validation and matching of patterns ('pypi.org', '*.github.io').

A pattern is a lower-case DNS name of letters, digits and hyphens, or '*.' and such a name:
'*.example.com' matches every name below example.com (a.example.com, a.b.example.com) but not
example.com itself, as in E2B. Matching is exact on labels: 'example.com' does not match
'badexample.com'. Shared by the policy model (dsec.types, importable by clients), the DNS forwarder and
the egress proxy.
"""

from __future__ import annotations

import ipaddress
import re

MAX_DOMAINS = 256
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_NAME_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})+$")


def normalize_name(name: str) -> str:
    """A queried or requested name as compared: lower case, no trailing dot."""
    return name.strip().rstrip(".").lower()


def pattern_error(value: str) -> str | None:
    """Why `value` is not a domain pattern (None if it is one)."""
    v = normalize_name(value)
    body = v[2:] if v.startswith("*.") else v
    if "*" in body:
        return f"{value[:80]!r}: '*' is allowed only as the whole first label ('*.example.com')"
    if len(v) > 253 or not _NAME_RE.match(body):
        return (f"{value[:80]!r} is not a domain name or wildcard: use e.g. 'pypi.org' or "
                "'*.githubusercontent.com' (letters, digits, hyphens; at least two labels)")
    try:
        ipaddress.ip_address(body)
        return f"{value!r} is an IP address, not a domain name: put it in a CIDR rule"
    except ValueError:
        pass
    return None


def is_pattern(value: str) -> bool:
    return pattern_error(value) is None


def normalize_pattern(value: str) -> str:
    err = pattern_error(value)
    if err:
        raise ValueError(err)
    return normalize_name(value)


def matches(name: str, patterns: "list[str] | tuple[str, ...] | frozenset[str]") -> bool:
    """Whether a host name is covered by any of the (normalized) patterns."""
    n = normalize_name(name)
    if not n or len(n) > 253:
        return False
    for p in patterns:
        if p.startswith("*."):
            if n.endswith(p[1:]) and len(n) > len(p) - 1:
                return True
        elif n == p:
            return True
    return False
