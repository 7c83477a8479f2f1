"""E2B sandbox ids <-> dsec sandbox ids.

E2B puts a sandbox id into hostnames (`{port}-{id}.{domain}`), so it must be one DNS label:
dsec's `sb-<node>.<12 hex>` has a dot. The E2B id is `<node>-<12 hex>`, the same information
without the `sb-` prefix and the dot. The split back is unambiguous: the random part is always
the last dash-separated part (12 hex digits), and a node id may itself contain dashes.
"""

from __future__ import annotations

from dsec.types import SANDBOX_ID_RE, NotFound


def to_e2b(sandbox_id: str) -> str:
    m = SANDBOX_ID_RE.match(sandbox_id)
    if not m:
        return sandbox_id          # not a dsec id: shown as it is (never produced by dsec)
    return f"{m.group('node')}-{m.group('rand')}"


def to_dsec(e2b_id: str) -> str:
    """The dsec id of an E2B id (a dsec id is accepted as well)."""
    if SANDBOX_ID_RE.match(e2b_id):
        return e2b_id
    node, _, rand = e2b_id.rpartition("-")
    dsec_id = f"sb-{node}.{rand}"
    if not node or not SANDBOX_ID_RE.match(dsec_id):
        raise NotFound(f"sandbox {e2b_id[:80]!r} was not found: not a sandbox id", field="sandboxID",
                       fix="use the sandboxID returned by Sandbox.create(), e.g. 'local-0123456789ab'")
    return dsec_id
