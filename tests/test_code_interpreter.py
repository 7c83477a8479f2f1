"""The `code-interpreter` image and dsec-code-interpreter (insandbox/code_interpreter_server.py),
the server e2b_code_interpreter talks to on port 49999, in real sandboxes.

The image is built here (module fixture, from the debootstrap cache that scripts/install.sh
fills) rather than in conftest's session `images` fixture: it is large (ipykernel, ipython,
debugpy + gdb) and only this module needs it. The server is exercised from inside the sandbox
with the image's own python3 + urllib (tests 1-9), then with the stock e2b_code_interpreter
client through dsec's E2B layer and port ingress (the last tests).
"""

from __future__ import annotations

import json
import shlex
import time

import pytest

from dsec import ContainerArgs

IMAGE = "code-interpreter"
URL = "http://127.0.0.1:49999"

# Runs in the sandbox: each request of argv[1] (a JSON list of {method, path, body?}) in turn;
# prints a JSON list of {status, lines: [[seconds since the request, parsed NDJSON line]], text}.
PROBE = r"""
import json, sys, time, urllib.error, urllib.request
out = []
for r in json.loads(sys.argv[1]):
    body = r.get("body")
    req = urllib.request.Request("http://127.0.0.1:49999" + r["path"], method=r["method"],
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, lines, text = resp.status, [], ""
            if resp.headers.get("Content-Type", "").startswith("application/x-ndjson"):
                for raw in iter(resp.readline, b""):
                    if raw.strip():
                        lines.append([time.monotonic() - t0, json.loads(raw)])
            else:
                text = resp.read().decode()
    except urllib.error.HTTPError as e:
        status, lines, text = e.code, [], e.read().decode()
    out.append({"status": status, "lines": lines, "text": text})
print(json.dumps(out))
"""

WAIT_HEALTH = ("python3 -c 'import time, urllib.request as u\n"
               "for _ in range(100):\n"
               "    try: u.urlopen(\"http://127.0.0.1:49999/health\", timeout=1); break\n"
               "    except OSError: time.sleep(0.1)\n"
               "else: raise SystemExit(\"not listening\")'")


@pytest.fixture(scope="module")
def ci_image(images):
    """The image, built into the test home (seconds from the debootstrap cache)."""
    from dsec.images.builtin import ensure_builtin
    t0 = time.monotonic()
    info = ensure_builtin(images, IMAGE)
    print(f"code-interpreter image: {time.monotonic() - t0:.1f}s")
    return info


def _args(**kw) -> ContainerArgs:
    return ContainerArgs(image=IMAGE, cpu_cores=2, memory_mb=1024, ttl_idle_s=600, **kw)


@pytest.fixture(scope="module")
async def ci_sb(server, ci_image):
    """One sandbox with the server started the way the E2B layer does (--daemon)."""
    async with server.client() as c:
        sb = await c.create_container(_args())
        r = await sb.run("dsec-code-interpreter --daemon")
        assert r.exit_code == 0, r
        await sb.files.write("/tmp/probe.py", PROBE)
        yield sb
        await sb.stop()


async def call(sb, *reqs: dict) -> list[dict]:
    r = await sb.run(f"python3 /tmp/probe.py {shlex.quote(json.dumps(list(reqs)))}", timeout_s=300)
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


def execute(code: str, **kw) -> dict:
    return {"method": "POST", "path": "/execute", "body": {"code": code, **kw}}


def of(resp: dict, kind: str) -> list[dict]:
    assert resp["status"] == 200, resp
    return [line for _, line in resp["lines"] if line["type"] == kind]


def main_text(resp: dict) -> str | None:
    mains = [r for r in of(resp, "result") if r["is_main_result"]]
    return mains[0].get("text") if mains else None


# ---------------------------------------------------------------------------------------
# the image; starting the server
# ---------------------------------------------------------------------------------------


def test_image_rebuilds_to_the_same_digest(ci_image, tmp_path):
    """Another home, the same debootstrap cache: the same digest; the server is in the image."""
    import stat

    from conftest import link_downloads

    from dsec.config import Paths
    from dsec.images import ImageService, LayerMounts, ensure_builtin
    from dsec.insandbox import source
    paths = Paths(tmp_path / "home")
    paths.home.mkdir()
    link_downloads(paths.home)
    svc = ImageService(paths)
    try:
        t0 = time.monotonic()
        again = ensure_builtin(svc, IMAGE)
        print(f"code-interpreter rebuild from the cache: {time.monotonic() - t0:.1f}s, "
              f"{again.size_bytes / 2**20:.0f} MiB")
        assert again.digest == ci_image.digest
        assert again.layers[0].source.startswith("debootstrap:bookworm+") and "python3-ipykernel" in again.layers[0].source
        [root] = svc.mount_image(IMAGE)
        server = root / "usr/local/bin/dsec-code-interpreter"
        st = server.stat()
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == 0
        assert server.read_bytes() == source("code_interpreter_server.py").read_bytes()
        assert (root / "usr/lib/python3/dist-packages/ipykernel").is_dir()
    finally:
        LayerMounts(paths).unmount_all()


async def test_image_starts_nothing_and_the_server_listens_fast(client, ci_image):
    sb = await client.create_container(_args())
    try:
        check = await sb.run("test -x /usr/local/bin/dsec-code-interpreter && "
                             "python3 -c 'import jupyter_client, ipykernel; print(jupyter_client.__version__)' && "
                             "! python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 49999), 1)' "
                             "2>/dev/null")
        assert check.exit_code == 0, check           # installed, importable, and nothing listens yet
        r = await sb.run("t=$(date +%s.%N); dsec-code-interpreter --daemon; rc=$?; "
                         "echo $rc $(echo \"$(date +%s.%N) - $t\" | python3 -c 'print(eval(input()))')")
        rc, took = r.stdout.split()
        assert rc == "0" and float(took) < 2.0, r.stdout
        # it listened before --daemon returned: no waiting needed
        health = await sb.run("python3 -c 'import urllib.request as u; "
                              "print(u.urlopen(\"http://127.0.0.1:49999/health\", timeout=2).read().decode())'")
        assert json.loads(health.stdout) == {"status": "ok"}
        again = await sb.run("dsec-code-interpreter --daemon")
        assert again.exit_code == 1 and "cannot listen" in again.stderr      # a second one says why
    finally:
        await sb.stop()


async def test_foreground_start_as_a_detached_exec(client, ci_image):
    sb = await client.create_container(_args())
    try:
        info = await sb.start("dsec-code-interpreter", timeout_s=600)
        assert info.running
        assert (await sb.run(WAIT_HEALTH)).exit_code == 0
        await sb.files.write("/tmp/probe.py", PROBE)
        _, b = await call(sb, execute("x = 41"), execute("x + 1"))
        assert main_text(b) == "42"
        await sb.signal(info.exec_id, 15)
        result = await sb.attach(info.exec_id)
        assert result.exit_code == 0, result         # SIGTERM: kernels shut down, clean exit
    finally:
        await sb.stop()


# ---------------------------------------------------------------------------------------
# /execute
# ---------------------------------------------------------------------------------------


async def test_state_is_kept_across_executions(ci_sb):
    a, b = await call(ci_sb, execute("x = 41"), execute("x + 1"))
    assert of(a, "result") == [] and of(a, "error") == []
    assert main_text(b) == "42"
    assert of(b, "end_of_execution") == [{"type": "end_of_execution"}]
    counts = [c["execution_count"] for c in of(a, "number_of_executions") + of(b, "number_of_executions")]
    assert len(counts) == 2 and counts[1] == counts[0] + 1


async def test_stdout_and_stderr_stream_as_they_come(ci_sb):
    [r] = await call(ci_sb, execute("import sys, time\nprint('first', flush=True)\ntime.sleep(1.5)\n"
                                    "print('second')\nprint('oops', file=sys.stderr)"))
    out = [(t, line["text"]) for t, line in r["lines"] if line["type"] == "stdout"]
    assert [text for _, text in out] == ["first\n", "second\n"]
    assert out[1][0] - out[0][0] > 1.0, out          # 'first' arrived before the sleep ended
    assert [line["text"] for line in of(r, "stderr")] == ["oops\n"]
    assert all(isinstance(line["timestamp"], int) for line in of(r, "stdout"))


async def test_an_exception_is_an_error_line(ci_sb):
    [r, after] = await call(ci_sb, execute("1 / 0"), execute("'still' + ' here'"))
    [err] = of(r, "error")
    assert err["name"] == "ZeroDivisionError" and err["value"] == "division by zero"
    assert "ZeroDivisionError" in err["traceback"] and isinstance(err["traceback"], str)
    assert main_text(after) == "'still here'"


async def test_rich_results(ci_sb):
    [r] = await call(ci_sb, execute(
        "from IPython.display import display, HTML, JSON, Markdown\n"
        "display(HTML('<b>hi</b>'))\ndisplay(Markdown('# title'))\n"
        "display({'application/x-custom': 'raw', 'text/plain': 'custom'}, raw=True)\n"
        "JSON({'a': 1})"))
    results = of(r, "result")
    assert [x["is_main_result"] for x in results] == [False, False, False, True]
    assert results[0]["html"] == "<b>hi</b>" and results[1]["markdown"] == "# title"
    assert results[2]["extra"] == {"application/x-custom": "raw"} and results[2]["text"] == "custom"
    assert results[3]["json"] == {"a": 1}


async def test_env_vars_apply_to_one_execution(ci_sb):
    code = "import os, subprocess\n(os.environ.get('GREETING'), subprocess.run('echo $GREETING', shell=True, " \
           "capture_output=True, text=True).stdout)"
    a, b = await call(ci_sb, execute(code, env_vars={"GREETING": "hello"}), execute(code))
    assert main_text(a) == "('hello', 'hello\\n')"
    assert main_text(b) == "(None, '\\n')"


async def test_timeout_interrupts_and_keeps_state(ci_sb):
    t0 = time.monotonic()
    resps = await call(ci_sb, execute("y = 7"), execute("import time\ntime.sleep(60)", timeout=1), execute("y * 6"))
    assert time.monotonic() - t0 < 30
    [err] = of(resps[1], "error")
    assert err["name"] == "TimeoutError"
    assert main_text(resps[2]) == "42"


async def test_a_dead_kernel_is_reported_and_replaced(ci_sb):
    _, b, c = await call(ci_sb, execute("z = 1"), execute("import os\nos._exit(3)"), execute("'z' in dir()"))
    [err] = of(b, "error")
    assert err["name"] == "DeadKernelError" and "exit status 3" in err["value"]
    assert main_text(c) == "False"                   # a fresh kernel: the state is gone


# ---------------------------------------------------------------------------------------
# /contexts
# ---------------------------------------------------------------------------------------


async def test_contexts_are_separate_kernels(ci_sb):
    [created] = await call(ci_sb, {"method": "POST", "path": "/contexts", "body": {"cwd": "/tmp"}})
    assert created["status"] == 201
    ctx = json.loads(created["text"])
    assert ctx["language"] == "python" and ctx["cwd"] == "/tmp" and ctx["id"]
    cid = ctx["id"]
    r = await call(ci_sb, execute("import os\nw = 5\nos.getcwd()", context_id=cid),
                   execute("'w' in dir()"),                                   # the default context
                   {"method": "GET", "path": "/contexts"},
                   {"method": "POST", "path": f"/contexts/{cid}/restart"},
                   execute("'w' in dir()", context_id=cid),
                   {"method": "DELETE", "path": f"/contexts/{cid}"},
                   execute("1", context_id=cid),
                   execute("1", language="java"))
    assert main_text(r[0]) == "'/tmp'" and main_text(r[1]) == "False"
    listed = {c["id"]: c for c in json.loads(r[2]["text"])}
    assert listed[cid] == ctx and listed["python"]["language"] == "python"
    assert r[3]["status"] == 204 and main_text(r[4]) == "False"
    assert r[5]["status"] == 204 and r[6]["status"] == 404 and r[7]["status"] == 400


# ---------------------------------------------------------------------------------------
# the stock e2b_code_interpreter client through dsec's E2B layer and port ingress
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e2b_sbx(e2b_env, ci_image):
    """An e2b_code_interpreter Sandbox of the image (the E2B layer starts its server)."""
    from e2b_code_interpreter import Sandbox
    sbx = Sandbox.create(IMAGE, timeout=600)
    yield sbx
    sbx.kill()


def test_e2b_run_code(e2b_sbx):
    from e2b import TimeoutException
    sbx = e2b_sbx
    assert sbx.run_code("x = 41").error is None
    assert sbx.run_code("x+1").text == "42"
    ex = sbx.run_code("print('hi')")
    assert ex.logs.stdout == ["hi\n"] and ex.results == [] and ex.error is None
    seen: list[str] = []
    ex = sbx.run_code("import sys\nprint('a')\nprint('b', file=sys.stderr)", on_stdout=lambda m: seen.append(m.line))
    assert seen == ["a\n"] and ex.logs.stderr == ["b\n"]
    err = sbx.run_code("1/0").error
    assert err is not None and err.name == "ZeroDivisionError" and err.value == "division by zero"
    assert "ZeroDivisionError" in err.traceback
    assert sbx.run_code("import os; os.environ['K']", envs={"K": "v"}).text == "'v'"
    ex = sbx.run_code("from IPython.display import HTML, display\ndisplay(HTML('<i>x</i>'))\n7")
    assert [r.html for r in ex.results if not r.is_main_result] == ["<i>x</i>"] and ex.text == "7"
    # the client's timeout drops the connection: the server interrupts the kernel, state kept
    with pytest.raises(TimeoutException):
        sbx.run_code("import time; time.sleep(60)", timeout=2)
    t0 = time.monotonic()
    assert sbx.run_code("x").text == "41"
    assert time.monotonic() - t0 < 15


def test_e2b_kernel_runs_as_user_in_its_home(e2b_sbx):
    """E2B's layout (issue 24, item 3): the kernel's cwd and HOME are /home/user, its user `user`."""
    code = "import getpass, os; (os.getcwd(), os.environ['HOME'], getpass.getuser(), os.getuid())"
    assert e2b_sbx.run_code(code).text == "('/home/user', '/home/user', 'user', 1000)"
    e2b_sbx.run_code("open('from-kernel.txt', 'w').write('k')")
    assert e2b_sbx.files.read("from-kernel.txt") == "k"          # relative: the same home


def test_e2b_code_contexts(e2b_sbx):
    sbx = e2b_sbx
    # the context calls send only E2B-Traffic-Access-Token (run_code sends X-Access-Token too)
    assert sbx.traffic_access_token
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert sbx.run_code("import os; w = 1; os.getcwd()", context=ctx).text == "'/tmp'"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("'w' in dir()", context=ctx).text == "False"
    sbx.remove_code_context(ctx.id)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]


def test_e2b_code_interpreter_drop_in_needs_no_start(e2b_env, ci_image):
    """Sandbox.create() + run_code() with nothing else, as with E2B's own template (no template
    named: the SDK asks for code-interpreter-v1, which is dsec's code-interpreter image)."""
    from e2b_code_interpreter import Sandbox
    sbx = Sandbox.create(timeout=600)
    try:
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x+1").text == "42"
        assert sbx.run_code("print('hi')").logs.stdout == ["hi\n"]
        err = sbx.run_code("1/0").error
        assert err is not None and err.name == "ZeroDivisionError"
    finally:
        sbx.kill()


def test_traffic_token_opens_only_its_own_sandboxs_ports(e2b_env, e2b_sbx):
    """The trafficAccessToken reaches the sandbox's ports, never its envd, never another sandbox."""
    import httpx
    from e2b_code_interpreter import Sandbox
    other = Sandbox.create(IMAGE, timeout=600)
    try:
        def get(sbx_id: str, port: int, path: str, token: str) -> int:
            return httpx.get(f"{e2b_env}{path}", headers={"E2b-Sandbox-Id": sbx_id, "E2b-Sandbox-Port": str(port),
                                                         "E2B-Traffic-Access-Token": token}, timeout=30).status_code
        mine = e2b_sbx.traffic_access_token
        assert get(e2b_sbx.sandbox_id, 49999, "/health", mine) == 200
        assert get(e2b_sbx.sandbox_id, 49983, "/health", mine) == 401      # not envd
        assert get(other.sandbox_id, 49999, "/health", mine) == 401        # not another sandbox
        assert get(other.sandbox_id, 49999, "/health", other.traffic_access_token) == 200
    finally:
        other.kill()


def test_get_host_names_reach_the_sandbox_port(server, e2b_env, e2b_sbx):
    """E2B's get_host(port) -> {port}-{sandboxID}.{domain}: the apiserver routes such a name (a
    wildcard DNS record points it at the apiserver; here the Host header stands in for DNS)."""
    import httpx
    from conftest import E2B_TEST_DOMAIN
    host = e2b_sbx.get_host(49999)
    assert host == f"49999-{e2b_sbx.sandbox_id}.{E2B_TEST_DOMAIN}"
    token = {"E2B-Traffic-Access-Token": e2b_sbx.traffic_access_token}
    r = httpx.get(f"{server.url}/health", headers={"Host": host, **token}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/execute", headers={"Host": host, **token}, timeout=60,
                   json={"code": "6*7", "context_id": None, "language": None, "env_vars": None})
    assert r.status_code == 200 and '"42"' in r.text, r.text
    # the name routes, it does not authenticate: no token, another sandbox's token, envd's port by name
    assert httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=30).status_code == 401
    envd = f"49983-{e2b_sbx.sandbox_id}.{E2B_TEST_DOMAIN}"
    assert httpx.get(f"{server.url}/health", headers={"Host": envd, **token}, timeout=30).status_code == 401
    # a name outside the domain is the plain API (which wants a key)
    r = httpx.get(f"{server.url}/health", headers={"Host": f"49999-{e2b_sbx.sandbox_id}.other.test", **token})
    assert r.status_code in (401, 404)
