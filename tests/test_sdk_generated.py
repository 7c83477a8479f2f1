"""The blocking SDK (dsec/sdk/sync.py) is generated, checked-in source: fresh, strictly typed,
and the async client's surface and behaviour. No server: an httpx mock transport answers."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import typing
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from dsec.sdk import _gen_sync, _sync
from dsec.sdk.client import Client, Created, Files, Sandbox
from dsec.sdk.sync import SyncClient, SyncCreated, SyncFiles, SyncSandbox
from dsec.types import ContainerArgs, ExecEvent, ExecResult, NotFound, SandboxInfo

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [(Client, SyncClient), (Created, SyncCreated), (Sandbox, SyncSandbox), (Files, SyncFiles)]


def test_checked_in_sync_py_is_what_the_generator_writes():
    p = subprocess.run([sys.executable, "-m", "dsec.sdk._gen_sync", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"regenerate with `python -m dsec.sdk._gen_sync`:\n{p.stdout}{p.stderr}"


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    target = tmp_path / "sync.py"
    target.write_text(_gen_sync.generate().replace("def stop(", "def stop_renamed("))
    monkeypatch.setattr(_gen_sync, "TARGET", target)
    assert _gen_sync.main(["--check"]) == 1
    assert "-    def stop_renamed(" in capsys.readouterr().out
    assert _gen_sync.main([]) == 0 and _gen_sync.main(["--check"]) == 0


def test_mypy_strict_is_clean():
    # The file list and strictness are in pyproject.toml ([tool.mypy]).
    p = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


def test_type_checkers_see_the_blocking_types(tmp_path):
    user = tmp_path / "user_code.py"
    user.write_text(
        "from dsec import ContainerArgs, SyncClient\n"
        "with SyncClient() as c:\n"
        "    sb = c.create_container(ContainerArgs(image='busybox'))\n"
        "    reveal_type(sb)\n"
        "    reveal_type(sb.files)\n"
        "    reveal_type(sb.files.read('/x'))\n"
        "    reveal_type(sb.stream('ls'))\n"
        "    for created in c.create_many(2, ContainerArgs(image='busybox')):\n"
        "        reveal_type(created.sandbox)\n"
        "    reveal_type(c.list())\n"
        "    sb.runn('typo')  # type: ignore[attr-defined]\n")   # strict: an unneeded ignore fails
    p = subprocess.run([sys.executable, "-m", "mypy", str(user)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    # mypy versions differ on whether builtins are written "builtins.bytes" or "bytes".
    revealed = [line.split("Revealed type is ", 1)[1].strip('"').replace("builtins.", "")
                for line in p.stdout.splitlines() if "Revealed type is" in line]
    assert revealed == ["dsec.sdk.sync.SyncSandbox", "dsec.sdk.sync.SyncFiles", "bytes",
                        "typing.Iterator[dsec.types.execs.ExecEvent]", "dsec.sdk.sync.SyncSandbox | None",
                        "list[dsec.types.sandboxes.SandboxInfo]"], p.stdout


def _members(cls: type) -> dict[str, typing.Any]:
    return {name: obj for name, obj in vars(cls).items()
            if not name.startswith("_") or name in ("__init__", "__aenter__", "__aexit__", "__enter__", "__exit__")}


@pytest.mark.parametrize("async_cls, sync_cls", PAIRS, ids=[s.__name__ for _, s in PAIRS])
def test_same_surface_as_the_async_class(async_cls, sync_cls):
    sync_members = _members(sync_cls)
    for name, obj in _members(async_cls).items():
        sync_obj = sync_members[_gen_sync.DUNDERS.get(name, name)]
        if isinstance(obj, property):
            assert isinstance(sync_obj, property) and sync_obj.__doc__ == obj.__doc__
            continue
        a, s = inspect.signature(obj), inspect.signature(sync_obj)
        assert [(p.name, p.kind, p.default) for p in a.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in s.parameters.values()], name
        if name != "__init__":
            assert inspect.getdoc(sync_obj) == inspect.getdoc(obj), name
        typing.get_type_hints(sync_obj)   # the annotations resolve at run time too
    declared = {k for k in vars(async_cls).get("__annotations__", {}) if not k.startswith("_")}
    assert declared <= set(sync_cls.__annotations__) | set(sync_members)
    assert _sync.blocking_class_of(async_cls) is sync_cls


# -- behaviour, against a fake apiserver ---------------------------------------------------------

class FakeApi:
    """Just enough of the HTTP API for the SDK calls below."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict[str, typing.Any]] = {}
        self.files: dict[str, bytes] = {}

    def info(self, sid: str, state: str = "running") -> dict[str, typing.Any]:
        now = datetime.now(timezone.utc).isoformat()
        return {"id": sid, "node": "local", "project": "p", "backend": "container", "state": state,
                "image": "busybox", "cpu_cores": 1.0, "memory_mb": 256, "ttl_idle_s": 60,
                "created_at": now, "last_active_at": now}

    def __call__(self, req: httpx.Request) -> httpx.Response:
        parts = req.url.path.strip("/").split("/")
        if parts == ["healthz"]:
            return httpx.Response(200, json={"ok": True})
        if parts == ["v1", "sandboxes"] and req.method == "POST":
            sid = f"sb-local.{len(self.sandboxes):012x}"
            self.sandboxes[sid] = self.info(sid)
            return httpx.Response(200, json=self.sandboxes[sid])
        if parts == ["v1", "sandboxes"]:
            return httpx.Response(200, json={"sandboxes": list(self.sandboxes.values())})
        sid = parts[2]
        if sid not in self.sandboxes:
            return httpx.Response(404, json={"error": {"code": "not_found", "message": f"no sandbox {sid}"}})
        rest = parts[3:]
        if not rest and req.method == "DELETE":
            self.sandboxes[sid] = self.info(sid, "stopped")
        if not rest:
            return httpx.Response(200, json=self.sandboxes[sid])
        if rest == ["exec"]:
            cmd = json.loads(req.content)["cmd"]
            return httpx.Response(200, json={"exec_id": "e1", "exit_code": 0, "stdout": f"{cmd}\n"})
        if rest == ["exec", "stream"]:
            events = [{"type": "start", "exec_id": "e2"}, {"type": "stdout", "data": "a\n"},
                      {"type": "exit", "result": {"exec_id": "e2", "exit_code": 0, "stdout": "a\n"}}]
            return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in events))
        if rest == ["files"] and req.method == "PUT":
            assert req.url.params["mode"] == str(0o644)
            self.files[req.url.params["path"]] = req.content
            return httpx.Response(200, json={})
        if rest == ["files"]:
            return httpx.Response(200, content=self.files[req.url.params["path"]])
        return httpx.Response(500, json={"error": {"code": "internal", "message": f"fake: {req.url}"}})


@pytest.fixture
def fake():
    return FakeApi()


@pytest.fixture
def client(fake):
    c = SyncClient("http://dsec.test", "key", autostart=False)
    impl = _sync.async_object(c)
    _sync.run(impl._http.aclose())
    impl._http = httpx.AsyncClient(base_url=impl.url, transport=httpx.MockTransport(fake))
    yield c
    c.close()


def test_blocking_calls_wrap_sdk_objects(client, fake):
    with client as same:
        assert same is client and client.url == "http://dsec.test" and client.autostart is False
        sb = client.create_container(image="busybox")
        assert isinstance(sb, SyncSandbox) and isinstance(sb.info, SandboxInfo) and sb.id in fake.sandboxes
        assert isinstance(sb.files, SyncFiles)
        r = sb.run("echo hi")
        assert isinstance(r, ExecResult) and r.stdout == "echo hi\n"
        events = sb.stream("ls")
        assert iter(events) is events
        assert [ev.type for ev in events] == ["start", "stdout", "exit"]
        assert all(isinstance(ev, ExecEvent) for ev in sb.stream("ls"))
        sb.files.write("/work/a", "x")
        assert sb.files.read("/work/a") == b"x" and sb.files.read_text("/work/a") == "x"
        created = list(client.create_many(3, ContainerArgs(image="busybox"), concurrency=2))
        assert sorted(c.index for c in created) == [0, 1, 2]
        assert all(isinstance(c, SyncCreated) and c.ok and isinstance(c.sandbox, SyncSandbox) for c in created)
        assert {s.id for s in client.list()} == set(fake.sandboxes)
        assert client.get(sb.id).id == sb.id
        with sb as entered:   # __exit__ stops it
            assert entered is sb
        assert fake.sandboxes[sb.id]["state"] == "stopped"
        sb.info = client.get(sb.id).refresh()   # attribute writes reach the async object
        assert _sync.async_object(sb).info.state.value == "stopped"


def test_exceptions_pass_through_unchanged(client):
    with pytest.raises(NotFound, match="no sandbox"):
        client.get("sb-local.000000000bad")
