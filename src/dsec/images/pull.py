"""Registry pulls: `skopeo copy docker://REF oci:DIR:TAG`, then the OCI layout import.

Why skopeo: it speaks every registry auth/TLS/manifest-list variant and is in Debian; we
only turn its result (an OCI layout) into EROFS layers, which oci.py already does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from dsec.types import InvalidArgument, NotFound, Unavailable

# docker://[host[:port]/]path[:tag][@sha256:...]
_REF_RE = re.compile(r"^docker://[A-Za-z0-9][A-Za-z0-9._:/-]*(?::[\w][\w.-]{0,127})?"
                     r"(?:@sha256:[0-9a-f]{64})?$")
LAYOUT_TAG = "pulled"


def skopeo_binary() -> str:
    exe = shutil.which("skopeo")
    if exe is None:
        raise Unavailable("skopeo is not installed on this node (registry pulls use it)",
                          fix="apt-get install -y skopeo")
    return exe


def check_ref(ref: str) -> str:
    if not isinstance(ref, str) or not _REF_RE.match(ref) or ".." in ref:
        raise InvalidArgument(f"{ref!r} is not a registry image reference", field="ref",
                              fix="use docker://HOST[:PORT]/REPO[:TAG][@sha256:DIGEST], e.g. "
                                  "docker://registry.example.com/team/py311:v2")
    return ref


def pull_to_layout(ref: str, dest: Path, *, tls_verify: bool = True, creds: str | None = None,
                   timeout_s: float = 1800) -> tuple[Path, str]:
    """Copy `ref` into a new OCI layout at `dest`. Returns (layout dir, ref name in it)."""
    check_ref(ref)
    if creds is not None and (not isinstance(creds, str) or ":" not in creds):
        raise InvalidArgument("registry credentials must be 'USER:PASSWORD'", field="creds",
                              fix="pass creds='user:token', or omit it for anonymous pulls")
    cmd = [skopeo_binary(), "--insecure-policy", "copy", "--retry-times", "2",
           f"--src-tls-verify={'true' if tls_verify else 'false'}"]
    if creds is not None:
        cmd.append(f"--src-creds={creds}")
    cmd += [ref, f"oci:{dest}:{LAYOUT_TAG}"]
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"pulling {ref} took more than {timeout_s:.0f}s", field="ref",
                          fix="check the registry is reachable and not overloaded, then retry") from None
    if p.returncode:
        raise _pull_error(ref, p.stderr.strip()[-1500:], tls_verify)
    return dest, LAYOUT_TAG


def _pull_error(ref: str, err: str, tls_verify: bool) -> Exception:
    low = err.lower()
    msg = f"skopeo could not pull {ref}: {err}"
    if "manifest unknown" in low or "name unknown" in low or "not found" in low:
        return NotFound(msg, field="ref", fix="check the repository and tag exist in the registry "
                                              "(`skopeo list-tags docker://HOST/REPO`)")
    if "unauthorized" in low or "authentication required" in low or "denied" in low:
        return InvalidArgument(msg, field="creds",
                               fix="pass creds='USER:PASSWORD' with pull access to the repository")
    if tls_verify and ("http response to https client" in low or "x509" in low or
                       "certificate" in low):
        return InvalidArgument(msg, field="tls_verify",
                               fix="the registry does not serve valid HTTPS; pass tls_verify=False "
                                   "(--no-tls-verify) only for a registry you trust")
    return Unavailable(msg, field="ref", fix="check the registry host and port are reachable from "
                                             "this node, then retry")


__all__ = ["pull_to_layout", "check_ref", "skopeo_binary"]
