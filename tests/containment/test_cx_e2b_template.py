"""Attacks through the E2B template build API (apiserver/e2b/templates.py): a tenant's COPY tar
and steps try to write or read outside the build. A template build is a Dockerfile build (the
same jail, test_cx_build.py); its uploads are unpacked as build contexts are (images/unpack.py:
chrooted bsdtar, `..` refused, links resolve inside the context)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import secrets
import shutil
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import stranger_key

pytestmark = pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah is not installed")


def _tar(entries: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for e in entries:
            info, data = e if isinstance(e, tuple) else (e, b"")
            t.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    i = tarfile.TarInfo(name)
    i.size = len(data)
    return i, data


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.type, i.linkname = kind, target
    return i


async def _build(url: str, key: str, tar: bytes, steps: list[dict]) -> dict:
    """Request, upload, start and wait: the build's last status."""
    h = {"X-API-KEY": key}
    digest = hashlib.sha256(tar).hexdigest()
    for s in steps:
        if s["type"] == "COPY":
            s["filesHash"] = digest
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(f"{url}/v3/templates", json={"name": f"cx-tpl-{secrets.token_hex(3)}"}, headers=h)
        assert r.status_code == 202, r.text
        tid, bid = r.json()["templateID"], r.json()["buildID"]
        link = (await c.get(f"{url}/templates/{tid}/files/{digest}", headers=h)).json()
        r = await c.put(link["url"], content=tar, headers=link["headers"])
        assert r.status_code == 201, r.text
        r = await c.post(f"{url}/v2/templates/{tid}/builds/{bid}",
                         json={"fromImage": "busybox", "steps": steps}, headers=h)
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            st = (await c.get(f"{url}/templates/{tid}/builds/{bid}/status", headers=h)).json()
            if st["status"] in ("ready", "error"):
                st["templateID"] = tid
                return st
            await asyncio.sleep(0.5)
    raise AssertionError("the build did not end")


def _escaped(tok: str, home: Path) -> list[str]:
    """Where the attacks' files would land outside the build (its work dir is under home/build)."""
    dirs = [Path("/"), Path("/tmp"), Path("/var/tmp"), home, home / "build"]
    return [str(p) for d in dirs for p in d.glob(f"escape*-{tok}")]


async def test_copy_tar_with_dotdot_paths_cannot_write_outside(server, dsec_home):
    tok = secrets.token_hex(6)
    key = stranger_key(server, "cx-tpl")
    tar = _tar([_file(f"../escape-{tok}", b"x"), _file(f"a/../../escape2-{tok}", b"x"), _file("ok.txt", b"ok")])
    st = await _build(f"{server.url}/e2b", key, tar, [{"type": "COPY", "args": [".", "/x", "", ""]}])
    assert st["status"] == "error" and ".." in st["reason"]["message"], st
    assert _escaped(tok, dsec_home) == []


async def test_copy_tar_links_resolve_inside_the_context(server, dsec_home, host_canary):
    tok = secrets.token_hex(6)
    key = stranger_key(server, "cx-tpl")
    url = f"{server.url}/e2b"
    # a file written through a symlink out of the context, a hard link to a host file: refused
    tar = _tar([_link("up", "/var/tmp", tarfile.SYMTYPE), _file(f"up/escape-{tok}", b"through the link"),
                _link("hard", str(host_canary), tarfile.LNKTYPE), _file("ok.txt", b"ok")])
    st = await _build(url, key, tar, [{"type": "COPY", "args": [".", "/x", "", ""]}])
    assert st["status"] == "error" and "cannot extract" in st["reason"]["message"], st
    assert _escaped(tok, dsec_home) == []
    # symlinks out of the context kept as links: COPY through them and RUN reading them see no host file
    tar = _tar([_link("up", "/var/tmp", tarfile.SYMTYPE), _link("soft", str(host_canary), tarfile.SYMTYPE),
                _file("ok.txt", b"ok")])
    steps = [{"type": "COPY", "args": [".", "/x", "", ""]},
             {"type": "COPY", "args": [f"up/{host_canary.name}", "/y/", "", ""]},
             {"type": "RUN", "args": [f"cat /x/soft /y/* /var/tmp/{host_canary.name} 2>&1; true"]}]
    st = await _build(url, key, tar, steps)
    assert host_canary.read_text() not in repr(st) and "HOST-CANARY" not in repr(st), repr(st)[:2000]
    if st["status"] == "ready":           # whatever was built holds no host file
        async with httpx.AsyncClient(timeout=120) as c:
            h = {"X-API-KEY": key}
            r = await c.post(f"{url}/sandboxes", json={"templateID": st["templateID"], "timeout": 60}, headers=h)
            assert r.status_code == 201, r.text
            await c.delete(f"{url}/sandboxes/{r.json()['sandboxID']}", headers=h)
    else:
        assert "failed" in st["reason"]["message"], st


def test_copy_sources_outside_the_template_dir_are_refused():
    from dsec.apiserver.e2b.template_steps import plan
    from dsec.types import InvalidArgument
    for src in ("../etc", "/etc/passwd", "a/../../b"):
        with pytest.raises(InvalidArgument) as e:
            plan({"fromImage": "busybox", "steps": [{"type": "COPY", "args": [src, "/x"], "filesHash": "0" * 64}]})
        assert e.value.field == "steps[0].args"
    # values cannot break out of their Dockerfile line
    p = plan({"fromImage": "busybox", "steps": [
        {"type": "RUN", "args": ["echo a\nFROM evil\nRUN --mount=type=bind,target=/h true"]},
        {"type": "ENV", "args": ["K", 'v"$X\\']},
        {"type": "COPY", "args": ['a"b', "/d\n"], "filesHash": "1" * 64}]})
    lines = p.dockerfile.splitlines()
    assert len(lines) == 4 and all(not ln.startswith(("FROM evil", "RUN --")) for ln in lines[1:]), lines
    for bad in ({"type": "ENV", "args": ["K", "v\nRUN x"]}, {"type": "WORKDIR", "args": ["/a\nRUN x"]},
                {"type": "USER", "args": ["root\nRUN x"]}):
        with pytest.raises(InvalidArgument):
            plan({"fromImage": "busybox", "steps": [bad]})
