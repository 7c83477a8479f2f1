"""Secrets added at the node's egress proxy (issue 30): what an operator stores, what a read
returns (never the value), and the rule an edge applies to a sandbox's outbound requests."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SECRET_NAME_RE = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
HEADER_NAME_RE = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$"
# a destination name: a whole name or "*." + name (dsec.types.domains' patterns)
SECRET_HOST_RE = r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?$"
# the ports a secret can be added on: TLS ports the node's egress proxy receives. Plain HTTP
# (80) is refused: the secret would cross the network in clear text.
SECRET_PORTS = (443,)
E2B_INLINE_MARK = "e2b.rules"   # ContainerArgs.secrets entry for an E2B create's inline transform rules


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Host = Annotated[str, Field(pattern=SECRET_HOST_RE, max_length=253)]


class SecretCreate(_Strict):
    """A credential and the destinations it is added to. Exactly one of `header` (the value
    is the header's whole value, e.g. "Bearer sk-...") or `basic_auth` ("user:password")."""

    name: Annotated[str, Field(pattern=SECRET_NAME_RE, description="unique in the project")]
    value: Annotated[str, Field(min_length=1, max_length=8192, description="the credential; never returned")]
    hosts: Annotated[list[Host], Field(min_length=1, max_length=32,
                                       description="destination names (`api.example.com`, `*.example.com`)")]
    ports: Annotated[list[int], Field(min_length=1, max_length=8, description="destination ports (TLS)")] = [443]
    header: Annotated[str | None, Field(pattern=HEADER_NAME_RE, description="header the value is put in")] = None
    basic_auth: Annotated[bool, Field(description="add it as `Authorization: Basic` of the value "
                                                  "(user:password)")] = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v.startswith("e2b."):
            raise ValueError("names starting with 'e2b.' are dsec's own; choose another name")
        return v

    @field_validator("value")
    @classmethod
    def _value(cls, v: str) -> str:
        if any(c in v for c in "\r\n\0"):
            raise ValueError("a header value cannot hold CR, LF or NUL")
        return v

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        bad = [p for p in v if p not in SECRET_PORTS]
        if bad:
            raise ValueError(f"{bad[0]} is not a port the egress proxy adds secrets on; use "
                             f"{list(SECRET_PORTS)} (TLS; plain HTTP would expose the secret)")
        return v

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        return [h.lower().rstrip(".") for h in v]

    @model_validator(mode="after")
    def _check(self) -> "SecretCreate":
        if (self.header is None) == (not self.basic_auth):
            raise ValueError("header: give exactly one of header (a header name) or basic_auth=true")
        if self.basic_auth and ":" not in self.value:
            raise ValueError("value: basic_auth takes 'user:password'")
        return self


class SecretInfo(_Strict):
    """What every read returns: never the value."""

    name: str
    project: str
    hosts: list[str]
    ports: list[int]
    header: str | None = None
    basic_auth: bool = False
    created_at: float


class SecretList(_Strict):
    items: list[SecretInfo]


class EgressSecret(_Strict):
    """One rule as an edge applies it: requests to `hosts` on `ports` get `headers` (set,
    replacing what the sandbox sent). Sent by the apiserver to the sandbox's edge only."""

    id: str                       # revocation key: the stored secret's id, or e2b:<sandbox> for inline rules
    hosts: list[str]
    ports: list[int] = [443]
    headers: dict[str, str]
    kind: Literal["stored", "inline", "socks5"] = "stored"
    # kind socks5: the RFC 1929 [username, password] of the sandbox's NetworkPolicy.egress_proxy
    # (its address travels in the policy; only the credentials take this in-memory path)
    auth: list[str] | None = None
