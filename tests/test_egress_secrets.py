"""Secrets added at the node's egress proxy (issue 30), with real sandboxes and local peers
(tests/secrets_peer.py): added only at the destination named, verified first, never inside."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dsec.backends.container.hibernate import on_disk

import secrets_peer
from secrets_peer import BASIC, SECRET, digest, headers_of, memory_holds, probe, sandbox_pids

speer, sserver = secrets_peer.speer, secrets_peer.sserver   # the module's fixtures


async def test_secret_api_never_returns_values_and_names_fields(sserver):
    async with sserver.client() as c:
        info = await c.create_secret("api-key", SECRET, ["secret.test"], header="X-Api-Key")
        assert info["name"] == "api-key" and SECRET not in json.dumps(info)
        listed = await c.list_secrets()
        assert [s["name"] for s in listed] == ["api-key"] and SECRET not in json.dumps(listed)
        # nothing of the value in the store's file either (encrypted under the key file)
        store_files = [p for p in Path(sserver.home).glob("iam.db*")]
        assert store_files and all(SECRET.encode() not in p.read_bytes() for p in store_files)
        # another tenant neither sees, removes nor uses it
        from conftest import stranger_key
        async with httpx.AsyncClient(base_url=sserver.url,
                                     headers={"Authorization": f"Bearer {stranger_key(sserver, 'sec')}"}) as h:
            assert (await h.get("/v1/secrets")).json()["items"] == []
            r = await h.delete("/v1/secrets/api-key")
            assert r.status_code == 404 and r.json()["error"]["field"] == "name", r.text
            r = await h.post("/v1/sandboxes", json={"image": "debian-python", "secrets": ["api-key"]})
            assert r.status_code == 422 and r.json()["error"]["field"] == "secrets[0]", r.text
        await c.delete_secret("api-key")
        async with httpx.AsyncClient(base_url=sserver.url, headers={"Authorization": f"Bearer {sserver.key}"}) as h:
            r = await h.post("/v1/secrets", json={"name": "x", "value": "v", "hosts": ["a.test"], "ports": [80],
                                                  "header": "X"})
            assert r.status_code == 422 and "ports" in r.text and "plain HTTP" in r.text, r.text
            r = await h.post("/v1/secrets", json={"name": "x", "value": "v", "hosts": ["a.test"]})
            assert r.status_code == 422 and "header" in r.text, r.text
            r = await h.post("/v1/sandboxes", json={"image": "debian-python", "secrets": ["nope"]})
            assert r.status_code == 422 and "secrets[0]" in r.text and "dsec secret create" in r.text, r.text


async def test_secret_added_only_at_its_destination_and_never_inside(sserver, speer):
    p = speer
    async with sserver.client() as c:
        await c.create_secret("api", SECRET, ["secret.test"], header="X-Api-Key")
        await c.create_secret("bad", BASIC, ["bad.test"], basic_auth=True)
        sb = await c.create_container(image="debian-python", secrets=["api", "bad"],
                                      network={"rules": [{"cidr": p.ip}, {"cidr": p.ip2}]})
        try:
            checks = [
                ["verified", "https://secret.test/headers", {}],
                ["other", "https://other.test/headers", {"verify": False}],
                ["redirect", "https://secret.test/redirect?to=https://other.test/headers", {"verify": False}],
                ["redirect_ip", f"https://secret.test/redirect?to=https://{p.ip}/headers", {"verify": False}],
                ["raw_ip", f"https://{p.ip}/headers", {"raw": True, "sni": "", "host": "secret.test"}],
                ["raw_ip2", f"https://{p.ip2}/headers", {"raw": True, "sni": "", "host": "secret.test"}],
                ["other_sni", f"https://{p.ip}/headers", {"raw": True, "sni": "other.test", "host": "secret.test"}],
                ["fronted", f"https://{p.ip}/headers", {"raw": True, "sni": "secret.test", "host": "other.test"}],
                ["plain_http", "http://secret.test/headers", {}],
                ["bad_cert", "https://bad.test/headers", {"verify": False}],
            ]
            r = await probe(sb, checks, linger_s=120)
            assert headers_of(r["verified"]).get("x-api-key") == digest(SECRET), r
            for name in ("other", "redirect", "redirect_ip", "raw_ip", "raw_ip2", "other_sni", "plain_http"):
                assert digest(SECRET) not in r[name], (name, r)
                assert r[name].startswith("ok:200"), (name, r)
            assert r["fronted"].startswith("ok:421"), r             # the secret is for its SNI name only
            assert r["bad_cert"].startswith("err:"), r              # no verified upstream: nothing sent
            # the sandbox's environment names the bundle, files and memory hold no secret
            env = (await sb.run("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", user="root")).stdout
            assert "SSL_CERT_FILE=/etc/dsec/egress-ca-bundle.pem" in env and SECRET not in env and \
                BASIC not in env
            # files: everything the sandbox wrote (its upper layer) and its tmpfs, read from the
            # host (a grep inside would itself put the secret into the sandbox)
            pids = sandbox_pids(sb.id)
            roots = [Path(sserver.home) / "sb" / sb.id / "upper", Path(f"/proc/{pids[0]}/root/dev/shm")]
            assert roots[0].is_dir(), roots
            written = [f for r in roots for f in r.rglob("*") if f.is_file() and not f.is_symlink()]
            assert any(f.name.startswith("sprobe") for f in written), written    # the probe's own files
            assert not [f for f in written for v in (SECRET, BASIC) if v.encode() in f.read_bytes()]
            assert len(pids) >= 2, pids                              # the agent and the lingering probe
            leaked = [pid for pid in pids for s in (SECRET, BASIC) if memory_holds(pid, s.encode())]
            assert not leaked, leaked
            # revoked: the next connection goes without it, as soon as the call returns
            t0 = time.monotonic()
            await c.delete_secret("api")
            took = time.monotonic() - t0
            r = await probe(sb, [["after", "https://secret.test/headers", {"verify": False}],
                                 ["after_verified", "https://secret.test/headers", {}]])
            assert "x-api-key" not in headers_of(r["after"]), r
            # no rule left: the TLS passes untouched (the destination's own certificate, which the
            # sandbox's bundle does not trust here: it is the test's local "public" CA)
            assert "CERTIFICATE_VERIFY_FAILED" in r["after_verified"], r
            assert took < 5, took
        finally:
            await sb.stop()
            await c.delete_secret("bad")


async def test_secret_destination_outside_the_policy_gets_nothing(sserver, speer):
    """A secret does not open egress: a sandbox whose policy does not reach the name is refused."""
    async with sserver.client() as c:
        await c.create_secret("api2", SECRET, ["secret.test"], header="X-Api-Key")
        sb = await c.create_container(image="debian-python", secrets=["api2"],
                                      network={"rules": [{"cidr": speer.ip2}]})
        try:
            r = await probe(sb, [["no_route", "https://secret.test/headers", {}]])
            assert r["no_route"].startswith("err:"), r
        finally:
            await sb.stop()
            await c.delete_secret("api2")


def test_cli_secret_create_ls_rm_never_prints_the_value(sserver):
    env = {**sserver.env, "DSEC_API_KEY": sserver.key}

    def dsec(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dsec", "secret", *args], env=env, input=stdin,
                              capture_output=True, text=True, timeout=120)
    made = dsec("create", "cli-key", "--host", "secret.test", "--host", "*.secret.test", "--header", "X-Key",
                stdin=SECRET + "\n")
    assert made.returncode == 0 and made.stdout.strip() == "cli-key", made.stderr
    ls = dsec("ls")
    assert ls.returncode == 0 and "cli-key" in ls.stdout and "*.secret.test" in ls.stdout and SECRET not in ls.stdout
    again = dsec("create", "cli-key", "--host", "secret.test", "--header", "X-Key", stdin="v\n")
    assert again.returncode == 2 and "field: name" in again.stderr and "dsec secret rm" in again.stderr
    assert dsec("rm", "cli-key").returncode == 0
    assert "cli-key" not in dsec("ls").stdout


async def test_secret_rules_survive_parking_to_disk(sserver, speer):
    async with sserver.client() as c:
        await c.create_secret("park", SECRET, ["secret.test"], header="X-Api-Key")
        sb = await c.create_container(image="debian-python", secrets=["park"], network={"rules": [{"cidr": speer.ip}]})
        try:
            assert (await sb.suspend()).state.value == "suspended"
            assert on_disk(Path(sserver.home) / "sb" / sb.id / "run")                  # runtime torn down
            r = await probe(sb, [["after", "https://secret.test/headers", {}]])     # a request resumes it
            assert headers_of(r["after"]).get("x-api-key") == digest(SECRET), r
        finally:
            await sb.stop()
            await c.delete_secret("park")
