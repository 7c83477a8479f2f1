"""The stock e2b SDK (PyPI `e2b`, sync `Sandbox` and async `AsyncSandbox`) against a real dsec
server, pointed at it by environment variables only (apiserver/e2b/, docs/e2b.md)."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from conftest import stranger_key

from dsec.apiserver.e2b.ids import to_dsec
from dsec.store import open_db
from dsec.store.sandboxes import SandboxIndex

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import AsyncSandbox, CommandExitException, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import (AuthenticationException, FileNotFoundException, InvalidArgumentException,
                            NotFoundException, SandboxException, SandboxNotRunningException)


TEMPLATE = "debian-python"


@pytest.fixture(scope="module")
def sbx(e2b_env):
    """One sandbox shared by the tests that only run commands and files in it."""
    s = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": "e2b"})
    yield s
    s.kill()


def test_create_reports_e2b_fields(sbx):
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and "." not in sbx.sandbox_id   # one DNS label
    assert info.template_id == TEMPLATE and info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": "e2b"} and info.cpu_count >= 1 and info.memory_mb > 0
    assert 550 < (info.end_at - info.started_at).total_seconds() <= 601
    assert sbx.is_running()


def test_run_foreground(sbx):
    r = sbx.commands.run("echo hello; echo oops >&2; printf '%s' \"$GREETING\"", envs={"GREETING": "hi there"})
    assert r.exit_code == 0 and r.stdout == "hello\nhi there" and r.stderr == "oops\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    seen: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; echo bad >&2; exit 3")
    assert e.value.exit_code == 3 and e.value.stdout == "partial\n" and e.value.stderr == "bad\n"
    assert sbx.commands.run("id -u", user="root").stdout == "0\n"


def test_background_wait_list_and_kill(sbx):
    h = sbx.commands.run("sleep 0.5; echo done", background=True)
    assert h.pid > 0
    assert h.wait().stdout == "done\n"
    long = sbx.commands.run("sleep 600", background=True)
    assert long.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(long.pid) is True
    with pytest.raises(CommandExitException):
        long.wait()
    assert long.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(long.pid) is False          # gone: not found


def test_stdin_then_close(sbx):
    h = sbx.commands.run("cat; echo end", background=True, stdin=True)
    h.send_stdin("line one\n")
    sbx.commands.send_stdin(h.pid, b"line two\n")
    h.close_stdin()
    assert h.wait().stdout == "line one\nline two\nend\n"


def test_connect_to_a_running_command(sbx):
    h = sbx.commands.run("echo early; sleep 1; echo late", background=True)
    h2 = sbx.commands.connect(h.pid)
    assert h2.wait().stdout == "early\nlate\n"       # dsec replays a command's output from its start
    h.disconnect()


def test_files(sbx):
    info = sbx.files.write("/tmp/e2b/a.txt", "hello file")
    assert info.path == "/tmp/e2b/a.txt" and info.name == "a.txt"
    assert sbx.files.read("/tmp/e2b/a.txt") == "hello file"
    blob = bytes(range(256)) * 4
    sbx.files.write("/tmp/e2b/b.bin", blob)
    assert bytes(sbx.files.read("/tmp/e2b/b.bin", format="bytes")) == blob
    sbx.files.write_files([{"path": "/tmp/e2b/m1", "data": "1"}, {"path": "/tmp/e2b/m2", "data": b"2"}])
    assert sbx.files.read("/tmp/e2b/m2") == "2"
    names = {e.name for e in sbx.files.list("/tmp/e2b")}
    assert names == {"a.txt", "b.bin", "m1", "m2"}
    assert sbx.files.make_dir("/tmp/e2b/sub/deep") is True
    assert sbx.files.make_dir("/tmp/e2b/sub/deep") is False
    assert {e.path for e in sbx.files.list("/tmp/e2b", depth=2)} >= {"/tmp/e2b/sub", "/tmp/e2b/sub/deep"}
    st = sbx.files.get_info("/tmp/e2b/a.txt")
    assert st.size == 10 and st.type.value == "file" and st.owner and st.permissions.startswith("-")
    assert sbx.files.exists("/tmp/e2b/a.txt") and not sbx.files.exists("/tmp/e2b/nope")
    moved = sbx.files.rename("/tmp/e2b/a.txt", "/tmp/e2b/new/place.txt")
    assert moved.path == "/tmp/e2b/new/place.txt" and sbx.files.read("/tmp/e2b/new/place.txt") == "hello file"
    sbx.files.remove("/tmp/e2b/sub")
    assert not sbx.files.exists("/tmp/e2b/sub")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/e2b/a.txt")
    with pytest.raises(SandboxException, match="metadata"):
        sbx.files.write("/tmp/e2b/x", "x", metadata={"k": "v"})


def test_list_with_metadata_filter_and_pages(e2b_env):
    tag = secrets.token_hex(4)
    made = [Sandbox.create("busybox", timeout=120, metadata={"run": tag, "i": str(i)}) for i in range(3)]
    try:
        found = Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()
        assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in made)
        one = Sandbox.list(query=SandboxQuery(metadata={"run": tag, "i": "1"})).next_items()
        assert [s.sandbox_id for s in one] == [made[1].sandbox_id]
        pager = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=2)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next
        rest = pager.next_items()
        assert len(rest) == 1 and not pager.has_next
        assert not Sandbox.list(query=SandboxQuery(metadata={"run": tag}, state=[SandboxState.PAUSED])).next_items()
    finally:
        for s in made:
            assert s.kill()
    assert not Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()


def test_kill_ends_the_sandbox(e2b_env):
    s = Sandbox.create("busybox", timeout=120)
    assert s.commands.run("echo x").stdout == "x\n"
    assert s.kill() is True
    assert s.is_running() is False
    with pytest.raises(SandboxNotRunningException):
        s.commands.run("echo x")
    assert Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(s.sandbox_id)


def test_kill_ends_the_index_row_and_the_quota_at_once(server, e2b_env):
    """An E2B kill stops through the same path as dsec's stop: the cross-node index row ends and
    the quota reservation is given back at once, not at the next index sync (15 s) or reconcile."""
    s = Sandbox.create("busybox", timeout=120)
    sid = to_dsec(s.sandbox_id)
    db = open_db(server.paths.iam_db)
    try:
        index = SandboxIndex(db)
        reserved = lambda: db.run(lambda tx: tx.all(                       # noqa: E731
            "SELECT id FROM quota_reservations WHERE sandbox_id=?", (sid,)), write=False)
        def row_when(done) -> object:
            deadline = time.monotonic() + 3.0     # the index writer batches for a fraction of a second
            row = index.get(sid)
            while not done(row) and time.monotonic() < deadline:
                time.sleep(0.1)
                row = index.get(sid)
            return row

        assert reserved()
        assert row_when(lambda r: r is not None) is not None, "the create was not indexed"
        assert s.kill() is True
        row = row_when(lambda r: r is not None and r.ended_at is not None)
        assert row is not None and row.ended_at is not None, "the killed sandbox's index row did not end"
        assert not reserved(), "the killed sandbox still holds its quota reservation"
    finally:
        db.close()


def test_set_timeout_ends_the_sandbox_after_its_lifetime(e2b_env):
    s = Sandbox.create("busybox", timeout=300)
    s.set_timeout(3)
    assert (s.get_info().end_at - s.get_info().started_at).total_seconds() < 300
    deadline = time.monotonic() + 30
    while s.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not s.is_running()
    with pytest.raises(NotFoundException):
        s.get_info()


def test_pause_and_resume_a_container(e2b_env):
    """A container pauses in place (frozen, memory to compressed swap) and comes back with its
    files and processes on connect, or on any request to it."""
    s = Sandbox.create("busybox", timeout=300)
    try:
        s.files.write("/tmp/kept", "state")
        h = s.commands.run("sleep 1; echo still-here", background=True)
        with pytest.raises(SandboxException, match="memory") as e:
            s.pause(mode="filesystem")                            # dsec pauses with the memory
        assert e.value.status_code == 400
        assert s.pause() is True
        assert s.get_info().state == SandboxState.PAUSED
        assert Sandbox.pause(s.sandbox_id) is False               # already paused (E2B's 409)
        again = Sandbox.connect(s.sandbox_id)
        assert again.get_info().state == SandboxState.RUNNING
        assert again.files.read("/tmp/kept") == "state"
        # the command ran on after the resume (a handle streaming across the pause was cut;
        # connecting again replays its output)
        assert again.commands.connect(h.pid).wait().stdout == "still-here\n"
        assert s.pause() is True
        assert s.commands.run("cat /tmp/kept").stdout == "state"  # any request resumes it
        assert s.get_info().state == SandboxState.RUNNING
    finally:
        s.kill()


def test_fields_dsec_cannot_honour_are_refused_by_name(e2b_env):
    with pytest.raises(SandboxException, match="autoResume") as e:
        Sandbox.create("busybox", lifecycle={"on_timeout": "pause", "auto_resume": False})
    assert e.value.status_code == 400
    with pytest.raises(SandboxException, match="network.allowOut.*not a domain name"):
        Sandbox.create("busybox", network={"allow_out": ["bad_name!"]})
    with pytest.raises(SandboxException, match="metadata"):
        Sandbox.create("busybox", metadata={"bad key!": "x"})
    with pytest.raises(SandboxException, match="templateID|no-such-template"):
        Sandbox.create("no-such-template")
    with pytest.raises(SandboxException, match="timeout"):
        Sandbox.create("busybox", timeout=30 * 24 * 3600)


def test_wrong_key_is_401(e2b_env):
    with pytest.raises(AuthenticationException):
        Sandbox.create("busybox", api_key="dsk_not-a-key")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="dsk_not-a-key").next_items()
    r = httpx.get(f"{e2b_env}/v2/sandboxes", headers={"X-API-KEY": "dsk_wrong"})
    assert r.status_code == 401 and r.json()["code"] == 401 and "message" in r.json()


def test_another_projects_sandbox_is_not_reachable(server, sbx, e2b_env):
    key = stranger_key(server, "e2b-other")
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=key).next_items()]
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, api_key=key)
    assert Sandbox.kill(sbx.sandbox_id, api_key=key) is False
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=key)
    # envd traffic needs this sandbox's access token: another's, or none, is refused
    mine = Sandbox.create("busybox", timeout=60, api_key=key)
    try:
        r = httpx.get(f"{e2b_env}/files", params={"path": "/etc/hostname"},
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
                               "X-Access-Token": mine._envd_access_token})
        assert r.status_code == 401 and r.json()["code"] == 401
        r = httpx.get(f"{e2b_env}/files", params={"path": "/etc/hostname"},
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id})
        assert r.status_code == 401
    finally:
        mine.kill()
    assert sbx.is_running()


def test_connect_returns_the_same_sandbox(sbx):
    again = Sandbox.connect(sbx.sandbox_id, timeout=900)
    assert again.sandbox_id == sbx.sandbox_id
    assert again.commands.run("echo via-connect").stdout == "via-connect\n"
    assert (again.get_info().end_at - again.get_info().started_at).total_seconds() > 800


def test_other_ports_go_to_the_port_ingress(sbx, e2b_env):
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000", "X-Access-Token": sbx._envd_access_token}
    from dsec.apiserver import ports
    if getattr(ports, "proxy_http", None) is None:
        r = httpx.get(f"{e2b_env}/", headers=headers)
        assert r.status_code == 501 and "port ingress" in r.json()["message"]
        return
    r = httpx.get(f"{e2b_env}/", headers=headers)
    assert r.status_code == 503 and r.json()["code"] == 503     # nothing listens yet, E2B-shaped
    sbx.files.write("/tmp/www/hello.txt", "served")
    sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(f"{e2b_env}/hello.txt", params={"x": "1"}, headers=headers)
        if r.status_code == 200:
            break
        time.sleep(0.3)
    assert r.status_code == 200 and r.text == "served"
    assert httpx.get(f"{e2b_env}/hello.txt", headers={**headers, "X-Access-Token": "ea_wrong"}).status_code == 401


HEADER_ECHO = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = str(self.headers).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", 8001), H).serve_forever()
"""


def test_port_traffic_does_not_hand_the_sandbox_its_access_tokens(sbx, e2b_env):
    """Issue 22, item 8: a server in the sandbox reached through E2B port traffic got the
    caller's X-Access-Token (the sandbox's envd token) among the request headers."""
    sbx.files.write("/tmp/echo_headers.py", HEADER_ECHO)
    sbx.commands.run("python3 /tmp/echo_headers.py", background=True)
    traffic = sbx._envd_access_token
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8001", "X-Access-Token": traffic,
               "X-Custom": "kept"}
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(f"{e2b_env}/h", headers=headers)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.status_code == 200, r.text
    seen = r.text.lower()
    assert "x-custom: kept" in seen
    assert traffic.lower() not in seen and "x-access-token" not in seen and "e2b-traffic-access-token" not in seen


async def test_async_sdk(e2b_env):
    s = await AsyncSandbox.create(TEMPLATE, timeout=120, metadata={"flavor": "async"})
    try:
        r = await s.commands.run("python3 -c 'print(6*7)'")
        assert r.stdout == "42\n"
        h = await s.commands.run("read x; echo got $x", background=True, stdin=True)
        await s.commands.send_stdin(h.pid, "it\n")
        assert (await h.wait()).stdout == "got it\n"
        await s.files.write("/tmp/async.txt", "async data")
        assert await s.files.read("/tmp/async.txt") == "async data"
        assert "async.txt" in [e.name for e in await s.files.list("/tmp")]
        with pytest.raises(CommandExitException):
            await s.commands.run("exit 5")
        found = await AsyncSandbox.list(query=SandboxQuery(metadata={"flavor": "async"})).next_items()
        assert s.sandbox_id in [x.sandbox_id for x in found]
        await s.set_timeout(60)
    finally:
        assert await s.kill()
    assert not await s.is_running()


def test_sdk_errors_for_bad_arguments(sbx):
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("true", user="nobody-here")


def test_pause_and_resume_a_vm(vm_client, e2b_env):
    s = Sandbox.create("busybox", timeout=300, metadata={"dsec.backend": "microvm"})
    try:
        s.files.write("/tmp/kept", "state")
        assert s.pause() is True
        assert s.get_info().state == SandboxState.PAUSED
        assert Sandbox.pause(s.sandbox_id) is False               # already paused (E2B's 409)
        assert s.sandbox_id in [x.sandbox_id for x in Sandbox.list(
            query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
        again = Sandbox.connect(s.sandbox_id)
        assert again.get_info().state == SandboxState.RUNNING
        assert again.files.read("/tmp/kept") == "state"
    finally:
        s.kill()


def test_files_as_root(sbx):
    sbx.commands.run("mkdir -p /root/e2b && echo secret > /root/e2b/f", user="root")
    assert sbx.files.exists("/root/e2b/f", user="root")
    assert sbx.files.get_info("/root/e2b/f", user="root").owner == "root"
    sbx.files.rename("/root/e2b/f", "/root/e2b/g", user="root")
    sbx.files.remove("/root/e2b", user="root")
    assert not sbx.files.exists("/root/e2b", user="root")
    # file calls act as the user they name (tests/compat/test_e2b_users.py has the rest)
    assert "e2b" not in [e.name for e in sbx.files.list("/root", user="root")]
    assert sbx.files.read("/etc/hostname", user="root")


def test_signed_file_urls_read_and_write_until_they_expire(server, sbx):
    """download_url/upload_url of a secured sandbox (issue 24, item 6): the URLs answered 401, since
    dsec knew no signature. Now GET/POST /files with E2B's v1 signature works without the token
    header, for that path and operation only, until its expiration. The URL's host is the
    sandbox's envd name under the apiserver's E2B domain (the Host header stands in for DNS)."""
    from urllib.parse import urlsplit

    from conftest import E2B_TEST_DOMAIN
    envd = {"Host": f"49983-{sbx.sandbox_id}.{E2B_TEST_DOMAIN}"}

    def at(url: str) -> str:          # the URL's path and query, sent to the apiserver by name
        u = urlsplit(url)
        return f"{server.url}/files?{u.query}"

    sbx.files.write("/tmp/signed.txt", "signed content")
    r = httpx.get(at(sbx.download_url("/tmp/signed.txt")), headers=envd, timeout=30)
    assert r.status_code == 200 and r.content == b"signed content", (r.status_code, r.text)
    url = at(sbx.upload_url("/tmp/up.txt", use_signature_expiration=60))
    r = httpx.post(url, headers=envd, files={"file": ("up.txt", b"uploaded")}, timeout=30)
    assert r.status_code == 200, r.text
    assert sbx.files.read("/tmp/up.txt") == "uploaded"
    # another path, another operation, a changed signature, an expired URL: 401, nothing read or written
    good = at(sbx.download_url("/tmp/signed.txt"))
    assert httpx.get(good.replace("signed.txt", "up.txt"), headers=envd, timeout=30).status_code == 401
    assert httpx.post(good, headers=envd, files={"file": ("x", b"x")}, timeout=30).status_code == 401
    assert httpx.get(good.replace("signature=v1_", "signature=v1_A"), headers=envd, timeout=30).status_code == 401
    expired = at(sbx.download_url("/tmp/signed.txt", use_signature_expiration=-5))
    r = httpx.get(expired, headers=envd, timeout=30)
    assert r.status_code == 401 and "expired" in r.text, r.text
    assert sbx.files.read("/tmp/signed.txt") == "signed content"
