"""Attacks from the code-interpreter image's kernels (issue 24 item 8): dsec's javascript and
bash kernels and Debian's IRkernel run inside the sandbox as the same user as the python one,
see none of the host, and leave nothing behind when the sandbox goes (node_intact checks the
host, the neighbour and stray processes after each test)."""

from __future__ import annotations

import time

import pytest

LANGS = {
    # language: (code printing the uid, code trying to read PATH, code forking a detached process)
    "python": ("import os; print(os.getuid())",
               "print(open({path!r}).read())",
               "import subprocess; subprocess.Popen(['setsid', 'sleep', '100000'])"),
    "javascript": ("console.log(process.getuid())",
                   "console.log(require('fs').readFileSync({path!r}, 'utf8'))",
                   "require('child_process').spawn('setsid', ['sleep', '100000'], "
                   "{detached: true, stdio: 'ignore'}).unref()"),
    "bash": ("id -u", "cat {path}", "setsid sleep 100000 >/dev/null 2>&1 &"),
    "r": ("cat(system('id -u', intern = TRUE), '\\n')", "cat(readLines({path!r}), '\\n')",
          "system('setsid sleep 100000 >/dev/null 2>&1 &')"),
}


@pytest.fixture(scope="module")
def ci_image(images):
    from dsec.images.builtin import ensure_builtin
    return ensure_builtin(images, "code-interpreter")


def test_kernels_run_as_the_sandbox_user_and_see_no_host(e2b_env, ci_image, host_canary):
    from e2b_code_interpreter import Sandbox
    sbx = Sandbox.create("code-interpreter", timeout=300)
    try:
        uids = {}
        for language, (uid, read, fork) in LANGS.items():
            ex = sbx.run_code(uid, language=language)
            assert ex.error is None, (language, ex.error)
            uids[language] = "".join(ex.logs.stdout).strip()
            ex = sbx.run_code(read.format(path=str(host_canary)), language=language)
            seen = "".join(ex.logs.stdout) + str(ex.text or "")
            assert "HOST-CANARY" not in seen, (language, seen)
            assert ex.error is not None or ex.logs.stderr, (language, ex)     # no such file here
            assert sbx.run_code(fork, language=language).error is None, language
        assert len(set(uids.values())) == 1 and uids["python"].isdigit(), uids
    finally:
        sbx.kill()
    time.sleep(1)          # node_intact: none of the detached sleeps is left on the host
