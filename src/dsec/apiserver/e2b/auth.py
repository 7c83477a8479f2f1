"""Per-sandbox envd access tokens (and per-volume content tokens, volume_content.py).

The e2b SDK sends a sandbox's `envdAccessToken` (from create/connect) as `X-Access-Token` on
every envd request. dsec mints it as an HMAC of the sandbox id under a server secret, so no
token is stored and every apiserver sharing the secret file accepts it; it opens that one
sandbox only. The secret lives beside the IAM database ($DSEC_HOME/e2b.secret, mode 0600).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

SECRET_FILE = "e2b.secret"
TOKEN_HEADER = "x-access-token"
TRAFFIC_HEADER = "e2b-traffic-access-token"   # ports other than envd's (code interpreter contexts ...)


def load_secret(home: Path) -> bytes:
    """The server secret, created once (O_EXCL: concurrent first starts agree on one)."""
    path = home / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return bytes.fromhex(path.read_text().strip())
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


class AccessTokens:
    def __init__(self, secret: bytes):
        self._secret = secret

    def token(self, sandbox_id: str) -> str:
        """The envd access token of a (dsec) sandbox id."""
        mac = hmac.new(self._secret, b"e2b-envd:" + sandbox_id.encode(), hashlib.sha256)
        return "ea_" + mac.hexdigest()[:48]

    def traffic_token(self, sandbox_id: str) -> str:
        """The token for the sandbox's other ports (E2B's trafficAccessToken): opens those, not envd."""
        mac = hmac.new(self._secret, b"e2b-traffic:" + sandbox_id.encode(), hashlib.sha256)
        return "et_" + mac.hexdigest()[:48]

    def volume_token(self, volume_id: str) -> str:
        """The token of a volume's content API (E2B's Volume.token): opens that volume's files."""
        mac = hmac.new(self._secret, b"e2b-volume:" + volume_id.encode(), hashlib.sha256)
        return "ev_" + mac.hexdigest()[:48]

    def check_volume(self, volume_id: str, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(self.volume_token(volume_id), token.strip())

    def check(self, sandbox_id: str, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(self.token(sandbox_id), token.strip())

    def check_traffic(self, sandbox_id: str, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(self.traffic_token(sandbox_id), token.strip())

    def check_signature(self, sandbox_id: str, path: str, operation: str, user: str,
                        signature: str, expiration: str | None) -> str | None:
        """A signed file URL (E2B's v1: sha256 of path:operation:user:token[:expiration],
        base64 without padding): None if it holds, else why not. The token never travels."""
        raw = f"{path}:{operation}:{user}:{self.token(sandbox_id)}"
        if expiration is not None:
            if not expiration.isdigit():
                return "signature_expiration is not a Unix time"
            if int(expiration) < time.time():
                return "the signed URL has expired"
            raw += f":{expiration}"
        want = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode("ascii")
        return None if hmac.compare_digest(want, signature) else "the URL's signature does not match"
