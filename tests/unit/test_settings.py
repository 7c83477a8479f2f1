"""dsec.settings: the one reader of DSEC_* names (issue 23), its doc and `dsec config`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsec import settings_doc
from dsec.settings import AdmissionSettings, Settings, mask, names, unknown_names
from dsec.types import InvalidArgument

SRC = Path(__file__).resolve().parents[2] / "src" / "dsec"
ENV_READ = re.compile(r"os\.environ|os\.getenv")
# env handed to child processes is not configuration
CHILD_ENV = re.compile(r"dict\(os\.environ|\{\*\*os\.environ|os\.environ\.copy\(\)")
# (file, what the line holds): the reads allowed outside dsec.settings, and why
ALLOWED = {
    ("sdk/client.py", "DSEC_URL"), ("sdk/client.py", "DSEC_API_KEY"),   # the SDK is a client: its own env
    ("sdk/client.py", "DSEC_BUSY_RETRY_S"), ("sdk/client.py", "DSEC_SDK_HTTP"),
    ("config.py", "DSEC_HOME"),               # Paths.from_env: the SDK's DSEC_HOME (it may import only config)
    ("cli/main.py", 'os.environ["DSEC_URL"] = '),  # `dsec up --background` tells the SDK's autostart its URL
    ("images/layerstore.py", "env = os.environ"),   # AWS_*: botocore's names, not dsec's
    ("images/dockerfile.py", '"PATH"'),   # buildah's own PATH, handed to its process
    ("cluster/local.py", "FAST_HEALTH"), ("cluster/local.py", "os.environ[k]"),   # RAY_* for Ray's processes
    ("cluster/local.py", "os.environ.pop(k"),
    ("testing/isolated.py", "self.env ="),    # the environment of a test server process
    ("cli/secrets.py", "os.environ.get(value_env"),   # `dsec secret create --value-env NAME`: the user's variable
}
NOT_SETTINGS = {"DSEC_AGENT_PROTOCOL_H", "DSEC_KEYS", "DSEC_RAM_READONLY", "DSEC_KSM_ALL",
                "DSEC_THP_OFF"}   # a header guard, a constant, a child's env (x3)


def _sources() -> list[tuple[str, int, str]]:
    out = []
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC).as_posix()
        if rel.startswith("insandbox/") or rel in ("settings.py", "settings_doc.py"):
            continue
        out += [(rel, i, line) for i, line in enumerate(f.read_text().splitlines(), 1)]
    return out


def test_no_module_reads_the_environment_but_the_settings() -> None:
    bad = [f"{rel}:{i}: {line.strip()}" for rel, i, line in _sources()
           if ENV_READ.search(line) and not CHILD_ENV.search(line)
           and not any(rel == f and what in line for f, what in ALLOWED)]
    assert not bad, "read DSEC_* settings from dsec.settings.Settings, passed down from a composition root:\n" \
        + "\n".join(bad)


def test_every_dsec_name_in_the_source_is_a_setting() -> None:
    known = names() | NOT_SETTINGS
    found = {m for _, _, line in _sources() for m in re.findall(r"\bDSEC_[A-Z0-9_]*[A-Z0-9]\b", line)}
    assert not found - known - {"DSEC_ADMIT_PSI"}, sorted(found - known)


def test_the_doc_is_generated_from_the_settings() -> None:
    assert settings_doc.main(["--check"]) == 0, "docs/settings.md is stale: run `python -m dsec.settings_doc`"
    doc = settings_doc.DOC.read_text()
    assert all(f"`{n}`" in doc for n in names())


def test_from_env_types_defaults_and_errors() -> None:
    s = Settings.from_env({"DSEC_MAX_SANDBOXES": "3", "DSEC_LAZY": "0", "DSEC_USERNS": "", "DSEC_HOME": "/x"})
    assert s.admission.max_sandboxes == 3 and s.images.lazy is False and s.containers.userns is True
    assert str(s.paths.home) == "/x" and str(s.with_home("/y").paths.home) == "/y"
    assert Settings().admission == AdmissionSettings() and Settings.from_env({}) == Settings()
    with pytest.raises(InvalidArgument) as e:
        Settings.from_env({"DSEC_WARM_POOL_PARALLEL": "99"})
    assert e.value.field == "DSEC_WARM_POOL_PARALLEL" and "default 2" in (e.value.fix or "")


def test_the_defaults_are_the_modules_own() -> None:
    from dsec.backends.container import idmap, qos
    from dsec.edge import admission, reclaim
    from dsec.store import db
    s = Settings()
    assert (s.admission.max_sandboxes, s.admission.cpu_overcommit, s.admission.mem_overcommit,
            s.admission.mem_reserve_mb, s.admission.sandbox_mb) == (
        admission.MAX_SANDBOXES, admission.CPU_OVERCOMMIT, admission.MEM_OVERCOMMIT, admission.MEM_RESERVE_MB,
        admission.SANDBOX_MB)
    assert (s.edge.reclaim_idle_s, s.edge.reclaim_pressed_idle_s, s.edge.reclaim_psi, s.edge.reclaim_per_tick) == (
        reclaim.IDLE_S, reclaim.PRESSED_IDLE_S, reclaim.PSI_LIMIT, reclaim.PER_TICK)
    assert (s.containers.idmap_first, s.containers.idmap_slots, s.containers.idmap_registry) == (
        idmap.FIRST, idmap.SLOTS, idmap.REGISTRY)
    assert s.containers.cpu_quota_floor_cores == qos.DEFAULT_QUOTA_FLOOR_CORES
    assert (s.cluster.db_retry_s, s.cluster.db_pool) == (db.RETRY_S, db.POOL_MAX)


def test_config_rows_mask_secrets_and_name_the_source() -> None:
    rows = {n: (v, src) for n, v, src in Settings.from_env(
        {"DSEC_DB_URL": "postgresql://dsec:hunter2@db/dsec", "DSEC_API_KEY": "sk-123"}).rows()}
    assert rows["DSEC_DB_URL"] == ("postgresql://dsec:***@db/dsec", "env")
    assert rows["DSEC_API_KEY"] == ("***", "env") and rows["DSEC_MAX_SANDBOXES"] == ("4000", "default")
    assert mask("s3://bucket/prefix") == "s3://bucket/prefix"
    assert unknown_names({"DSEC_MAX_SANDBOXE": "1", "DSEC_HOME": "/x", "PATH": "/bin"}) == ["DSEC_MAX_SANDBOXE"]
