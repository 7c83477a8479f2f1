"""The stock e2b SDK's template build API (Template / AsyncTemplate) against a real dsec server:
the builder's steps become a Dockerfile built in the caller's project (apiserver/e2b/templates.py),
and Sandbox.create(name) starts it (docs/e2b.md)."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import stranger_key

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
pytestmark = pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah is not installed")

from e2b import AsyncSandbox, AsyncTemplate, Sandbox, Template, wait_for_file
from e2b.exceptions import BuildException, SandboxException


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _context(tmp_path: Path) -> Path:
    (tmp_path / "local.txt").write_text("from the template dir\n")
    return tmp_path


def _template(cls, ctx: Path):
    return (cls(file_context_path=ctx).from_image("debian-python")
            .run_cmd("echo hi > /hello")
            .copy("local.txt", "/app/local.txt")
            .set_envs({"GREETING": "hello there", "QUOTED": 'a "b" $HOME'})
            .set_workdir("/app"))


def test_sync_build_then_sandbox_sees_files_env_and_workdir(e2b_env, tmp_path):
    name = _name("tpl-sync")
    logs: list[str] = []
    info = Template.build(_template(Template, _context(tmp_path)), alias=name,
                          on_build_logs=lambda e: logs.append(e.message))
    assert info.template_id == name and info.build_id
    assert any("STEP" in line or "building" in line for line in logs), logs
    assert Template.exists(name) and not Template.exists(_name("tpl-none"))
    sbx = Sandbox.create(name, timeout=120, envs={"EXTRA": "1"})
    try:
        r = sbx.commands.run('cat /hello /app/local.txt; echo "$GREETING|$QUOTED|$EXTRA"; pwd')
        assert r.stdout == 'hi\nfrom the template dir\nhello there|a "b" $HOME|1\n/app\n', r.stdout
    finally:
        sbx.kill()


async def test_async_build_with_start_and_ready_commands(e2b_env, tmp_path):
    name = _name("tpl-async")
    t = (_template(AsyncTemplate, _context(tmp_path))
         .set_start_cmd("echo started > /tmp/started; sleep 600", wait_for_file("/tmp/started")))
    await AsyncTemplate.build(t, name)
    assert await AsyncTemplate.exists(name)
    sbx = await AsyncSandbox.create(name, timeout=120)
    try:
        r = await sbx.commands.run("cat /tmp/started /app/local.txt; echo $GREETING")
        assert r.stdout == "started\nfrom the template dir\nhello there\n", r.stdout
    finally:
        await sbx.kill()


def test_failing_run_reports_the_build_failure_with_its_log(e2b_env, server, tmp_path):
    t = Template(file_context_path=tmp_path).from_image("debian-python").run_cmd("echo boom-output; exit 7")
    logs: list[str] = []
    with pytest.raises(BuildException) as e:
        Template.build(t, _name("tpl-fail"), on_build_logs=lambda x: logs.append(x.message))
    assert "boom-output" in str(e.value) and "failed" in str(e.value), str(e.value)
    assert any("boom-output" in line for line in logs)
    # nothing of the failed build stays behind: its uploads and context are removed
    assert list((server.paths.home / "build").glob("e2b-template-*")) == []


def test_network_inside_a_build_fails_with_the_builds_own_error(e2b_env, tmp_path):
    t = Template(file_context_path=tmp_path).from_image("debian-python").run_cmd(
        "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=3)'")
    with pytest.raises(BuildException) as e:
        Template.build(t, _name("tpl-net"))
    assert "unreachable" in str(e.value).lower() or "network" in str(e.value).lower(), str(e.value)


def test_bases_registry_images_and_unknown_steps_are_named(e2b_env, images, tmp_path):
    # an E2B default (from_base_image: e2bdev/base) is dsec's e2b-base, as Sandbox.create("base")
    from dsec.images.builtin import ensure_builtin
    ensure_builtin(images, "e2b-base")
    name = _name("tpl-base")
    Template.build(Template(file_context_path=tmp_path).from_base_image().run_cmd("python3 -V > /v"), name)
    sbx = Sandbox.create(name, timeout=60)
    try:
        assert sbx.commands.run("cat /v").stdout.startswith("Python 3")
    finally:
        sbx.kill()
    with pytest.raises(Exception) as e:
        Template.build(Template().from_image("python:3.12").run_cmd("true"), _name("tpl-reg"))
    assert "fromImage" in str(e.value) and "python:3.12" in str(e.value), str(e.value)
    with pytest.raises(Exception) as e:
        Template.build(Template().from_image("debian-python"), _name("tpl-cpu"), cpu_count=4)
    assert "cpuCount" in str(e.value), str(e.value)


def test_another_project_cannot_see_use_or_take_a_template(e2b_env, server, tmp_path):
    name = _name("tpl-own")
    mine, other = stranger_key(server, "tpl-a"), stranger_key(server, "tpl-b")   # the root key's are published
    Template.build(Template(file_context_path=tmp_path).from_image("busybox").run_cmd("echo mine > /m"), name,
                   api_key=mine)
    assert Template.exists(name, api_key=mine) and not Template.exists(name, api_key=other)
    sbx = Sandbox.create(name, api_key=mine, timeout=30)
    try:
        assert sbx.commands.run("cat /m").stdout == "mine\n"
    finally:
        sbx.kill()
    with pytest.raises(SandboxException, match="not found"):
        Sandbox.create(name, api_key=other, timeout=30)
    with pytest.raises(Exception) as e:       # names are shared: another project's is not theirs to replace
        Template.build(Template().from_image("busybox"), name, api_key=other)
    assert "another project" in str(e.value), str(e.value)
    with pytest.raises(Exception) as e:       # nor may they build on it
        Template.build(Template().from_template(name), _name("tpl-on"), api_key=other)
    assert "404" in str(e.value) and "fromTemplate" in str(e.value), str(e.value)
    # a build's status is its project's only
    url = e2b_env
    h = {"X-API-KEY": mine}
    r = httpx.post(f"{url}/v3/templates", json={"name": _name("tpl-st")}, headers=h)
    assert r.status_code == 202, r.text
    tid, bid = r.json()["templateID"], r.json()["buildID"]
    assert httpx.get(f"{url}/templates/{tid}/builds/{bid}/status", headers=h).json()["status"] == "waiting"
    assert httpx.get(f"{url}/templates/{tid}/builds/{bid}/status",
                     headers={"X-API-KEY": other}).status_code == 404
    assert httpx.put(f"{url}/templates/{tid}/files/{'0' * 64}", content=b"x",
                     headers={"X-API-KEY": other}).status_code == 404
    assert httpx.post(f"{url}/v2/templates/{tid}/builds/{bid}", json={"fromImage": "busybox", "steps": []},
                      headers={"X-API-KEY": other}).status_code == 404
