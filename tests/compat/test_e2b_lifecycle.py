"""The stock e2b SDK's lifecycle={"on_timeout": "pause", "auto_resume": True}: the timeout
parks the sandbox, and the next envd call or port request resumes it (files, processes, env
kept); auto_resume False is refused by name."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException


def _wait_state(sandbox_id: str, want: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        state = Sandbox.get_info(sandbox_id).state.value      # info does not resume it
        if state == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"sandbox {sandbox_id} not {want} after {timeout_s} s (last: {state})")


def test_timeout_pauses_and_envd_or_port_traffic_resumes(e2b_env, server):
    from conftest import E2B_TEST_DOMAIN
    sbx = Sandbox.create("debian-python", timeout=2, envs={"MARK": "kept"},
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        info = sbx.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}, info.lifecycle
        sbx.files.write("/tmp/www/index.html", "hello from before the pause\n")
        sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8000", background=True)
        assert sbx.get_host(8000).endswith(E2B_TEST_DOMAIN)
        url = f"{server.url}/index.html"
        headers = {"Host": sbx.get_host(8000), "E2B-Traffic-Access-Token": sbx.traffic_access_token or ""}
        deadline = time.monotonic() + 60
        while True:              # the server is up (each request also resumes a paused sandbox)
            r = httpx.get(url, headers=headers, timeout=30)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert r.text == "hello from before the pause\n", r.text
        for _ in range(2):
            _wait_state(sbx.sandbox_id, "paused")
            r = httpx.get(url, headers=headers, timeout=60)     # port traffic resumes it
            assert r.status_code == 200 and r.text == "hello from before the pause\n", r.text
            _wait_state(sbx.sandbox_id, "paused")
            out = sbx.commands.run("echo $MARK; cat /tmp/www/index.html")   # envd resumes it
            assert out.stdout == "kept\nhello from before the pause\n", out
    finally:
        sbx.kill()


def test_auto_resume_off_is_refused_by_name(e2b_env):
    with pytest.raises((InvalidArgumentException, SandboxException)) as e:
        Sandbox.create("busybox", timeout=30, lifecycle={"on_timeout": "pause", "auto_resume": False})
    assert "autoResume" in str(e.value), e.value
    sbx = Sandbox.create("busybox", timeout=30, lifecycle={"on_timeout": "kill"})
    try:
        assert sbx.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": True}
    finally:
        sbx.kill()
