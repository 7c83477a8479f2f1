"""Registry pulls through skopeo, against a real local registry (Debian's docker-registry,
the CNCF distribution server) on 127.0.0.1: push an OCI layout with skopeo, pull it back
with ImageService.pull and the CLI, check content and whiteouts, and the bad-input errors."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.images.service import ImageService
from dsec.types import InvalidArgument, NotFound
from test_oci import _tar, _write_oci

REGISTRY = shutil.which("docker-registry") or shutil.which("registry")

pytestmark = [
    pytest.mark.skipif(shutil.which("skopeo") is None,
                       reason="needs skopeo (apt-get install -y skopeo)"),
    pytest.mark.skipif(REGISTRY is None,
                       reason="needs docker-registry (apt-get install -y docker-registry)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (EROFS mounts)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def registry(tmp_path: Path):
    port = _free_port()
    cfg = tmp_path / "registry.yml"
    cfg.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                   f"    rootdirectory: {tmp_path / 'regdata'}\n"
                   f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([REGISTRY, "serve", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "registry.log", "wb"))
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("registry did not start: "
                                + (tmp_path / "registry.log").read_text()[-800:])
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _push(layout: Path, dest: str) -> None:
    subprocess.run(["skopeo", "--insecure-policy", "copy", "--dest-tls-verify=false",
                    f"oci:{layout}:latest", f"docker://{dest}"], check=True,
                   capture_output=True, timeout=120)


def test_pull_from_registry(registry, tmp_path):
    l1 = _tar([("etc/", None), ("etc/hello", "hi\n"), ("srv/", None), ("srv/gone", "x\n"),
               ("srv/old/", None), ("srv/old/a", "a\n")])
    l2 = _tar([("srv/", None), ("srv/.wh.gone", ""), ("srv/old/", None),
               ("srv/old/.wh..wh..opq", ""), ("srv/old/b", "b\n")])
    _push(_write_oci(tmp_path / "oci", [l1, l2]), f"{registry}/team/app:v1")
    svc = ImageService(Paths(tmp_path / "home"))
    try:
        info = svc.pull("pulled", f"docker://{registry}/team/app:v1", tls_verify=False)
        assert len(info.layers) == 1 and info.layers[0].source.startswith("docker://")
        (root,) = svc.mount_image("pulled")
        assert (root / "etc" / "hello").read_text() == "hi\n"
        assert not (root / "srv" / "gone").exists()                 # whiteout applied
        assert sorted(os.listdir(root / "srv" / "old")) == ["b"]    # opaque dir applied
        # split into two EROFS layers: the whiteouts stay overlay whiteouts
        two = svc.pull("pulled2", f"docker://{registry}/team/app:v1", tls_verify=False,
                       merge_bytes=1)
        assert len(two.layers) == 2
    finally:
        svc.mounts.unmount_all()


def test_pull_bad_input(registry, tmp_path):
    svc = ImageService(Paths(tmp_path / "home"))
    before = sorted(p.name for p in svc.paths.store.iterdir())
    with pytest.raises(InvalidArgument) as e:
        svc.pull("x", "registry/app:v1")                            # no transport
    assert e.value.field == "ref" and "docker://" in e.value.fix
    with pytest.raises(NotFound) as e:
        svc.pull("x", f"docker://{registry}/team/missing:v9", tls_verify=False)
    assert e.value.field == "ref"
    with pytest.raises(InvalidArgument) as e:                       # plain-HTTP registry
        svc.pull("x", f"docker://{registry}/team/missing:v9")
    assert e.value.field == "tls_verify"
    with pytest.raises(InvalidArgument) as e:
        svc.pull("x", f"docker://{registry}/a:b", creds="nocolon")
    assert e.value.field == "creds"
    with pytest.raises(NotFound):
        svc.get("x")
    assert sorted(p.name for p in svc.paths.store.iterdir()) == before
    assert not list((svc.paths.home / "build").glob("pull-*"))


def test_cli_image_pull(registry, tmp_path):
    _push(_write_oci(tmp_path / "oci", [_tar([("etc/", None), ("etc/motd", "m\n")])]),
          f"{registry}/cli/app:v1")
    env = {**os.environ, "DSEC_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "dsec", "image", "pull", "cli-pulled",
                        f"docker://{registry}/cli/app:v1", "--no-tls-verify"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert ImageService(Paths(tmp_path / "home")).get("cli-pulled").layers
    r = subprocess.run([sys.executable, "-m", "dsec", "image", "pull", "y", "nope:1"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "docker://" in r.stderr
