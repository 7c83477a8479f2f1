"""FnCall backend end to end: SDK and HTTP -> apiserver -> edge -> warm pool containers.

Runs against the session server (real crun containers, the fncall-python image). One small
extra server checks the pool's floor, ceiling and replacement with tight settings.
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import pytest

from conftest import side_server
from dsec import SyncClient
from dsec.types import FnCallRequest, FnCallStatus, InvalidArgument, NotFound

C_SUM = '#include <stdio.h>\nint main(void){long a,b; if(scanf("%ld %ld",&a,&b)!=2) return 2; printf("%ld\\n",a+b); return 0;}\n'
CPP_HELLO = '#include <iostream>\n#include <vector>\nint main(){std::vector<int> v{1,2,3}; std::cout << v.size() << std::endl;}\n'


async def test_python_call_result_shape(client):
    r = await client.fncall("import sys\nprint(sys.stdin.read()[::-1])\nprint('err', file=sys.stderr)", stdin="abc")
    assert r.status == FnCallStatus.ok and r.ok
    assert (r.stdout, r.stderr, r.exit_code, r.signal) == ("cba\n", "err\n", 0, None)
    assert r.compile is None and r.run is not None and r.run.stdout == "cba\n"
    assert 0 < r.wall_s < 5 and r.cpu_s > 0 and r.total_s >= r.wall_s
    assert r.language == "python" and r.executor.startswith("sb-")
    r = await client.fncall("import sys\nprint(sys.argv[1:])\nimport os\nprint(os.environ['X'])", args=["a", "b"],
                            env={"X": "y"}, files={"data/in.txt": "hello"}, fetch_files=["data/in.txt", "nope"])
    assert r.stdout == "['a', 'b']\ny\n"
    assert r.files == {"data/in.txt": base64.b64encode(b"hello").decode()}


async def test_languages_and_steps_timed_separately(client):
    r = await client.fncall(C_SUM, "c", stdin="40 2")
    assert (r.status, r.stdout) == (FnCallStatus.ok, "42\n")
    assert r.compile is not None and r.compile.exit_code == 0 and r.run.wall_s > 0
    assert r.compile.cached or r.compile.wall_s > r.run.wall_s   # compiling takes longer than running
    r = await client.fncall(CPP_HELLO, "cpp")
    assert (r.status, r.stdout) == (FnCallStatus.ok, "3\n")
    r = await client.fncall("echo $((6*7)); echo oops >&2; exit 3", "bash")
    assert (r.status, r.stdout, r.stderr, r.exit_code) == (FnCallStatus.runtime_error, "42\n", "oops\n", 3)
    r = await client.fncall("int main(void) { return undefined_name; }", "c")
    assert r.status == FnCallStatus.compile_error and r.run is None and "undefined_name" in r.stderr
    r = await client.fncall("print((", "python")
    assert r.status == FnCallStatus.compile_error and "SyntaxError" in r.stderr
    r = await client.fncall("raise SystemExit(5)")
    assert (r.status, r.exit_code) == (FnCallStatus.runtime_error, 5)
    r = await client.fncall("import numpy as np\nprint(int(np.arange(10).sum()))")
    assert r.stdout == "45\n"


async def test_compile_cache_same_code_compiles_once(client):
    code = C_SUM.replace("int main", "/* cache test */ int main")
    first = await client.fncall(code, "c", stdin="1 2")
    again = await client.fncall(code, "c", stdin="3 4")
    assert (first.stdout, again.stdout) == ("3\n", "7\n")
    assert not first.compile.cached and again.compile.cached and again.executor == first.executor
    other = await client.fncall(code + "\n", "c", stdin="1 1")
    assert not other.compile.cached


async def test_limits_are_reported_and_the_pool_keeps_serving(client):
    t0 = time.monotonic()
    r = await client.fncall("while True: pass", timeout_s=1)
    assert r.status == FnCallStatus.timeout and r.run.timed_out and time.monotonic() - t0 < 8
    r = await client.fncall("x = bytearray(2 << 30)", memory_mb=128)
    assert r.status == FnCallStatus.memory
    r = await client.fncall("#include <stdlib.h>\n#include <string.h>\n#include <stdio.h>\n"
                            "int main(void){char*p=malloc(3UL<<30); if(!p){perror(\"malloc\"); return 1;}"
                            " memset(p,1,3UL<<30); return 0;}", "c", memory_mb=256)
    assert r.status == FnCallStatus.memory
    t0 = time.monotonic()   # 10 GB of output: killed at the cap, not after writing it
    r = await client.fncall("import sys\nb = b'x' * (1 << 20)\nfor _ in range(10240): sys.stdout.buffer.write(b)",
                            output_cap_bytes=1 << 20)
    assert r.status == FnCallStatus.output_limit and len(r.stdout) == 1 << 20 and r.run.stdout_bytes > 1 << 20
    assert time.monotonic() - t0 < 5
    r = await client.fncall("yes", "bash", output_cap_bytes=4096)
    assert r.status == FnCallStatus.output_limit and r.stdout.startswith("y\ny\n")
    r = await client.fncall("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", timeout_s=2,
                            max_processes=32)
    assert r.status == FnCallStatus.timeout
    r = await client.fncall(":(){ :|:& };:", "bash", timeout_s=2)       # the script itself may end first
    assert r.status in (FnCallStatus.ok, FnCallStatus.timeout, FnCallStatus.runtime_error)
    r = await client.fncall("sleep 1000 & sleep 1000 & setsid sleep 1000 & echo started", "bash")
    assert (r.status, r.stdout) == (FnCallStatus.ok, "started\n")         # leftovers are killed after
    r = await client.fncall("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=3)\nprint('connected')")
    assert r.status == FnCallStatus.runtime_error and "connected" not in r.stdout
    rs = await asyncio.gather(*(client.fncall(f"print({i})") for i in range(8)))
    assert [x.stdout for x in rs] == [f"{i}\n" for i in range(8)]


async def test_consecutive_calls_in_one_container_are_isolated(client):
    leave = r'''
import ctypes, os, subprocess
open('/tmp/secret_a', 'w').write('s1'); os.chmod('/tmp/secret_a', 0o644)
open('secret_w', 'w').write('s2'); os.chmod('secret_w', 0o644); os.chmod('.', 0o755)
open('/dev/shm/secret_s', 'w').write('s3'); os.chmod('/dev/shm/secret_s', 0o644)
subprocess.Popen(['sleep', '1000'], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp('sleep', ['sleep', '1001'])
    os._exit(0)
libc = ctypes.CDLL(None)
assert libc.shmget(0x4242, 4096, 0o1666) >= 0
print(os.getcwd(), os.getuid())
'''
    look = r'''
import glob, os, sys
cwd_a = sys.argv[1]
found = glob.glob('/tmp/*') + glob.glob('/var/tmp/*') + glob.glob('/dev/shm/secret*')
found += [p for p in (cwd_a, cwd_a + '/secret_w') if os.path.exists(p)]
me = os.getpid()
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        cmd = open(f'/proc/{pid}/cmdline', 'rb').read()
    except OSError:
        continue
    if b'sleep' in cmd:
        found.append(f'process {pid} {cmd!r}')
shm = [l for l in open('/proc/sysvipc/shm').read().splitlines()[1:] if l.split()[0] == str(0x4242)]
print(repr((found, shm, os.getuid())))
'''
    for _ in range(5):   # the pool hands out the most recently used idle container
        a = await client.fncall(leave)
        assert a.status == FnCallStatus.ok, a
        cwd_a, uid_a = a.stdout.split()
        b = await client.fncall(look, args=[cwd_a])
        if b.executor == a.executor:
            break
    assert b.executor == a.executor, "two consecutive calls never shared a container"
    assert b.status == FnCallStatus.ok, b
    found, shm, uid_b = eval(b.stdout)
    assert (found, shm) == ([], []), b.stdout
    assert str(uid_b) == uid_a                    # same container, same call uid: cleanup did it


async def test_fncall_many_reports_each_call(client):
    calls: list = [{"code": f"print({i} * 2)"} for i in range(150)]
    calls[7] = {"code": "print(1)", "language": "no-such-language"}
    calls[11] = {"language": "python"}                                   # no code
    calls[20] = FnCallRequest(code="exit(3)")
    calls[30] = {"code": '#include <stdio.h>\nint main(void){puts("c");}', "language": "c"}
    rs = await client.fncall_many(calls, concurrency=24)
    assert len(rs) == len(calls)
    for i, r in enumerate(rs):
        if i in (7, 11):
            assert r.status == FnCallStatus.sandbox_error and r.error
        elif i == 20:
            assert (r.status, r.exit_code) == (FnCallStatus.runtime_error, 3)
        elif i == 30:
            assert r.stdout == "c\n"
        else:
            assert (r.status, r.stdout) == (FnCallStatus.ok, f"{i * 2}\n"), (i, r)
    assert "no-such-language" in rs[7].error and "language" in rs[7].error


def test_sync_client_has_fncall(server):
    with SyncClient(server.url, server.key) as c:
        assert c.fncall("print(6 * 7)").stdout == "42\n"
        rs = c.fncall_many([{"code": "print('x')"}, {"code": "echo y", "language": "bash"}])
        assert [r.stdout for r in rs] == ["x\n", "y\n"]
        assert any(p["pool"].startswith("fncall-python/") for p in c.fncall_pools())


def test_sandboxfusion_run_code_verl_shaped(server):
    """What verl's sandbox_fusion utilities POST (URL switch only; the key rides in the URL)."""
    url = f"{server.url}/run_code?api_key={server.key}"
    headers = {"Content-Type": "application/json", "Accept": "application/json"}

    def post(**fields):
        payload = {"compile_timeout": 10, "run_timeout": 10, "code": "", "stdin": "", "language": "python",
                   "files": {}, "fetch_files": [], **fields}
        return httpx.post(url, json=payload, headers=headers, timeout=60)

    r = post(code="a, b = map(int, input().split())\nprint(a + b)", stdin="2 3", memory_limit_MB=1024)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert body["status"] == "Success" and body["compile_result"] is None and body["message"] == ""
    assert set(body["run_result"]) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["return_code"] == 0
    assert body["run_result"]["stdout"] == "5\n" and body["run_result"]["execution_time"] > 0

    body = post(code=CPP_HELLO.replace("v.size()", "v.size() + 1"), language="cpp").json()
    assert body["status"] == "Success" and body["compile_result"]["status"] == "Finished"
    assert body["compile_result"]["return_code"] == 0 and body["run_result"]["stdout"] == "4\n"

    body = post(code="int main( {", language="cpp").json()
    assert body["status"] == "Failed" and body["compile_result"]["return_code"] != 0 and body["run_result"] is None

    body = post(code="import time\ntime.sleep(30)", run_timeout=1).json()
    assert body["status"] == "Failed" and body["run_result"]["status"] == "TimeLimitExceeded"
    assert body["run_result"]["return_code"] is None

    body = post(code="raise ValueError('no')").json()
    assert body["status"] == "Failed" and body["run_result"]["return_code"] == 1 and "ValueError" in body["run_result"]["stderr"]

    body = post(code="open('out.txt', 'w').write(open('in.txt').read() * 2)",
                files={"in.txt": base64.b64encode(b"ab").decode()}, fetch_files=["out.txt"]).json()
    assert body["status"] == "Success" and base64.b64decode(body["files"]["out.txt"]) == b"abab"

    r = post(code="x", language="cobol")
    assert r.status_code == 422 and r.json()["error"]["field"] == "language"
    r = httpx.post(f"{server.url}/run_code", json={"code": "print(1)", "language": "python"}, timeout=30)
    assert r.status_code == 401 and "api_key" in r.json()["error"]["fix"]
    r = httpx.post(f"{server.url}/run_code", json={"code": "print(1)", "language": "python"}, timeout=30,
                   headers={"Authorization": f"Bearer {server.key}"})
    assert r.json()["run_result"]["stdout"] == "1\n"


def test_bad_requests_name_the_field(server):
    h = {"Authorization": f"Bearer {server.key}"}

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/fncall", json=body, headers=h, timeout=30)

    for body, field in [({"code": "x", "timeout_s": -1}, "timeout_s"),
                        ({"code": "x", "memory_mb": 1 << 30}, "memory_mb"),
                        ({"code": "x", "typo": 1}, "typo"),
                        ({"code": "x", "files": {"../escape": "x"}}, "files"),
                        ({"code": "x", "files_b64": {"a": "not base64!"}}, "files_b64"),
                        ({"code": "x", "language": "klingon"}, "language"),
                        ({"code": "x", "language": "nodejs"}, "language")]:   # not in this image
        r = post(body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["field"] == field, (body, r.text)
    r = post({"code": "x", "image": "no-such-image"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "image"
    with pytest.raises(InvalidArgument):
        with SyncClient(server.url, server.key) as c:
            c.fncall("x", "klingon")
    with pytest.raises(NotFound):
        with SyncClient(server.url, server.key) as c:
            c.fncall("x", image="no-such-image")


@pytest.fixture
def tight_server(images, dsec_home, tmp_path_factory):
    """A server whose pools have floor 1, ceiling 2, 1 s idle time and 4 calls per container."""
    with side_server(dsec_home, tmp_path_factory, "fncall", {"DSEC_FNCALL_MAX_WARM": "2", "DSEC_FNCALL_IDLE_S": "1",
                                                             "DSEC_FNCALL_MAX_CALLS": "4"}) as srv:
        yield srv


async def test_pool_grows_to_its_ceiling_shrinks_to_its_floor_and_replaces_containers(tight_server):
    async with tight_server.client() as c:
        rs = await c.fncall_many([{"code": "import time; time.sleep(0.3); print(1)"}] * 8, concurrency=8)
        assert all(r.stdout == "1\n" for r in rs)
        used = {r.executor for r in rs}
        assert len(used) >= 2                        # it grew under load ...
        pools = {p["pool"]: p for p in await c.fncall_pools()}
        assert pools["fncall-python/python"]["workers"] <= 2   # ... never beyond the ceiling
        # after max_calls=4 a container is replaced: 8 sequential calls see more than 2 containers
        seq = [await c.fncall("print(2)") for _ in range(8)]
        assert all(r.ok for r in seq) and len(used | {r.executor for r in seq}) > 2
        deadline = time.monotonic() + 20            # idle for 1 s above the floor: retired
        while (await c.fncall_pools())[0]["workers"] > 1:
            assert time.monotonic() < deadline, await c.fncall_pools()
            await asyncio.sleep(0.5)
        assert (await c.fncall("print(3)")).stdout == "3\n"
