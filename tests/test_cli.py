"""The CLI against a live server: `dsec run`, `dsec sandbox create|exec|ls|rm`, `dsec image ls`."""

from __future__ import annotations

import subprocess
import sys


def dsec(server, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**server.env, "DSEC_API_KEY": server.key}
    p = subprocess.run([sys.executable, "-m", "dsec", *args], env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_run_streams_output_and_exit_code(server):
    p = dsec(server, "run", "busybox", "--", "echo hello; exit 3", check=False)
    assert p.stdout == "hello\n" and p.returncode == 3


def test_sandbox_commands(server):
    sid = dsec(server, "sandbox", "create", "busybox").stdout.strip()
    assert sid.startswith("sb-local.")
    assert dsec(server, "sandbox", "exec", sid, "--", "echo", "from-cli").stdout == "from-cli\n"
    assert sid in dsec(server, "sandbox", "ls").stdout
    dsec(server, "sandbox", "rm", sid)
    assert sid not in dsec(server, "sandbox", "ls").stdout


def test_argv_after_dashes_arrives_intact(server):
    """Several arguments are an argv (each quoted), one argument is a shell command line."""
    p = dsec(server, "run", "debian-python", "--", "python3", "-c", "print(6*7)")
    assert p.stdout == "42\n"
    p = dsec(server, "run", "busybox", "--", "printf", "%s|", "a b", "$HOME", "it's")
    assert p.stdout == "a b|$HOME|it's|"
    assert dsec(server, "run", "busybox", "--", "echo a | tr a b").stdout == "b\n"


def test_bad_input_is_actionable(server):
    p = dsec(server, "sandbox", "create", "no-such-image", check=False)
    assert p.returncode == 2 and "field: image" in p.stderr and "fix:" in p.stderr


def test_image_ls(server):
    out = dsec(server, "image", "ls").stdout
    assert "busybox" in out and "debian-python" in out


def test_down_finds_the_server_without_its_pid_file_and_a_second_up_is_refused(dsec_home, images,
                                                                                 tmp_path_factory):
    """Issue 22, item 11: server.pid vanished under a live server (a second `dsec up` on the
    home wrote its pid there, failed, and removed the file), and `dsec down` then answered "not
    running". The server now holds a lock on its home; `down` finds the holder."""
    from conftest import ServerProc, _cleanup_home, side_home
    srv = ServerProc(side_home(dsec_home, tmp_path_factory, "cli-lock"))
    srv.start()
    try:
        pid_file = srv.paths.server_pid
        assert pid_file.read_text().strip() == str(srv.proc.pid)
        second = ServerProc(srv.home)
        second_up = subprocess.run([sys.executable, "-m", "dsec", "up", "--port", str(second.port)],
                                   env=second.env, capture_output=True, text=True, timeout=60)
        assert second_up.returncode != 0 and "already serves" in second_up.stdout + second_up.stderr
        assert "DSEC_HOME" in second_up.stdout + second_up.stderr
        assert pid_file.read_text().strip() == str(srv.proc.pid)     # left as it was
        pid_file.unlink()
        # `down` waits for the pid to go; the server is this test's child: reap it meanwhile
        down = subprocess.Popen([sys.executable, "-m", "dsec", "down", "--timeout-s", "30"],
                                env={**srv.env, "DSEC_API_KEY": srv.key}, stdout=subprocess.PIPE, text=True)
        assert srv.proc.wait(timeout=30) is not None
        assert "stopped" in down.communicate(timeout=30)[0]
        assert "not running" in dsec(srv, "down").stdout
    finally:
        srv.kill()
        _cleanup_home(srv.home)


def test_up_in_the_background_serves_on_its_port(dsec_home, images, tmp_path_factory):
    """`dsec up --background --port P` started `dsec up` without its flags: it served on 7620
    while the CLI waited on P (and gave up); with DSEC_URL set elsewhere it waited there."""
    import httpx
    from conftest import ServerProc, _cleanup_home, side_home
    srv = ServerProc(side_home(dsec_home, tmp_path_factory, "cli-bg"))     # its home and a free port
    env = {**srv.env, "DSEC_URL": "http://127.0.0.1:9"}                     # nothing serves there
    try:
        up = subprocess.run([sys.executable, "-m", "dsec", "up", "--background", "--port", str(srv.port)],
                            env=env, capture_output=True, text=True, timeout=120)
        assert up.returncode == 0 and f"serving at {srv.url}" in up.stdout, up.stdout + up.stderr
        assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200
    finally:
        subprocess.run([sys.executable, "-m", "dsec", "down", "--timeout-s", "30"], env=env, timeout=60)
        _cleanup_home(srv.home)
