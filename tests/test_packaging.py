"""`pip install dsec-sandbox` (no extras) is a working client: SDK, blocking SDK and the CLI's
client commands import and run without the server's packages; `dsec-sandbox[server]` brings those.
Proved without a network: a subprocess whose import system refuses the server-only packages; and
for real: the built wheel in a clean venv (which needs the package index)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

from dsec.config import SERVER_INSTALL, SERVER_MODULES

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# The extras' own modules, plus what only they pull in (opentelemetry comes with fastapi).
BLOCKED = sorted(SERVER_MODULES | {"opentelemetry"})

PRELUDE = textwrap.dedent(f"""
    import sys
    BLOCKED = {BLOCKED!r}
    attempts = []

    class RefuseServerPackages:
        # First on sys.meta_path: `import fastapi` fails as if it were not installed.
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                attempts.append(name)
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, RefuseServerPackages())
""")


def run_client_only(code: str) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH kept: a checkout tested with PYTHONPATH=src (a worktree) is the one imported
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "200",
           **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_client_modules_import_without_server_packages():
    p = run_client_only("""
        import dsec, dsec.sdk.client, dsec.sdk.sync, dsec.cli, dsec.types, dsec.config
        from dsec import SyncClient, Client
        assert SyncClient.__module__ == "dsec.sdk.sync"
        assert not attempts, attempts   # not even tried (and an ImportError swallowed)
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_cli_client_commands_run_without_server_packages():
    for argv in (["--help"], ["sandbox", "--help"], ["sandbox", "create", "--help"], ["run", "--help"]):
        p = run_client_only(f"""
            import runpy
            sys.argv = ["dsec", *{argv!r}]
            try:
                runpy.run_module("dsec", run_name="__main__")
            finally:
                assert not attempts, attempts
        """)
        assert p.returncode == 0 and "Usage" in p.stdout, (argv, p.stdout + p.stderr)


def test_client_command_reaches_the_server_without_server_packages():
    # No server at this URL: the client command fails the client way (exit 2, actionable).
    p = run_client_only("""
        import os, runpy
        os.environ["DSEC_URL"] = "http://127.0.0.1:9"
        sys.argv = ["dsec", "sandbox", "ls"]
        runpy.run_module("dsec", run_name="__main__")
    """)
    assert p.returncode == 2 and "no dsec apiserver at http://127.0.0.1:9" in p.stderr, p.stdout + p.stderr


def test_server_command_names_the_extra():
    p = run_client_only("""
        import runpy
        sys.argv = ["dsec", "up"]
        runpy.run_module("dsec", run_name="__main__")
    """)
    assert p.returncode == 2, p.stdout + p.stderr
    assert SERVER_INSTALL in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_sdk_autostart_names_the_extra_instead_of_waiting():
    p = run_client_only("""
        from dsec.sdk.client import start_local_server
        from dsec.types import Unavailable
        try:
            start_local_server()
        except Unavailable as e:
            print(e.fix)
    """)
    assert p.returncode == 0 and SERVER_INSTALL in p.stdout, p.stdout + p.stderr


def test_core_dependencies_have_no_server_packages():
    core = names(PYPROJECT["dependencies"])
    server = names(PYPROJECT["optional-dependencies"]["server"])
    assert {"pydantic", "httpx", "typer", "rich"} <= core
    assert {"fastapi", "uvicorn", "structlog", "qemu.qmp"} <= server
    assert not core & server
    test = names(PYPROJECT["optional-dependencies"]["test"])
    assert {"mypy", "pytest", "pytest-asyncio", "build", PYPROJECT["name"]} <= test
    # Every module the server extra installs is in dsec.config.SERVER_MODULES, and no
    # core package provides one of them.
    by_module = importlib.metadata.packages_distributions()
    for module in SERVER_MODULES:
        owners = {d.lower() for d in by_module.get(module, [])}
        assert not owners & core, (module, owners)
    for dist in server:
        top = {f.parts[0].removesuffix(".py") for f in importlib.metadata.files(dist) or []
               if f.parts[0] not in ("..", "bin") and not f.parts[0].endswith((".dist-info", ".pth"))}
        assert top and top <= SERVER_MODULES | {"__pycache__"}, (dist, top)


def test_install_scripts_install_the_server_and_for_tests_the_test_extras():
    """The main job's install is the server alone; the tests' part (run by scripts/test.sh) adds
    the test extra."""
    assert ".[server]" in (ROOT / "scripts" / "install.sh").read_text()
    assert ".[server,test]" in (ROOT / "scripts" / "install-extras.sh").read_text()
    assert "install-extras.sh tests" in (ROOT / "scripts" / "test.sh").read_text()


def test_the_distribution_name_is_ours():
    # `dsec` and `dsec-sdk` on PyPI are other projects: `pip install dsec` would not be this one.
    assert PYPROJECT["name"] == "dsec-sandbox"
    assert PYPROJECT["scripts"] == {"dsec": "dsec.cli:main"}
    assert SERVER_INSTALL == "pip install 'dsec-sandbox[server]'"


def test_wheel_installs_the_client_alone_in_a_clean_venv(tmp_path):
    """`python -m build` (the sdist, then the wheel from it) and the wheel in a fresh venv, its
    dependencies from the package index: `import dsec.sdk` and `dsec --help` work, and none of
    the server's packages came with it."""
    tree = tmp_path / "tree"      # a copy: the build writes egg-info and build/ into the tree it builds
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dist = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(tree)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in dist.iterdir()) == ["dsec_sandbox-0.1.0-py3-none-any.whl",
                                                      "dsec_sandbox-0.1.0.tar.gz"]
    wheel = dist / "dsec_sandbox-0.1.0-py3-none-any.whl"
    files = set(zipfile.ZipFile(wheel).namelist())
    on_disk = {f.relative_to(ROOT / "src").as_posix() for f in (ROOT / "src" / "dsec").rglob("*.py")}
    assert on_disk <= files, sorted(on_disk - files)     # every module, backends/vm's too
    assert {"dsec/py.typed", "dsec/insandbox/dsec-agent.c", "dsec/insandbox/agent/protocol.h", "dsec/insandbox/agent/exec.c",
            "dsec/backends/vm/ramshim.c"} <= files

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, env["PATH"] = venv / "bin" / "python", f"{venv / 'bin'}:/usr/bin:/bin"
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = subprocess.run([str(py), "-c", textwrap.dedent(f"""
        import importlib.metadata as md, importlib.util, sys
        import dsec, dsec.sdk, dsec.sdk.sync
        from dsec import SyncClient
        assert dsec.__file__.startswith(sys.prefix), dsec.__file__     # the wheel's, not the checkout's
        assert md.version("dsec-sandbox") == "0.1.0"
        present = [m for m in {sorted(SERVER_MODULES)!r} if importlib.util.find_spec(m)]
        assert not present, present
        print("ok")
    """)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
    dsec_cmd = str(venv / "bin" / "dsec")
    p = subprocess.run([dsec_cmd, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Usage" in p.stdout, p.stdout + p.stderr
    p = subprocess.run([dsec_cmd, "up"], cwd=tmp_path, env={**env, "COLUMNS": "200"}, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and SERVER_INSTALL in p.stderr, p.stdout + p.stderr
