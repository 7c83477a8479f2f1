"""The images behind E2B's default templates hold what E2B's do (issue 24 item 8), seen with the
stock `e2b` and `e2b_code_interpreter` SDKs against a real server:

- `base` (e2b's Sandbox.create() default, dsec's `e2b-base`): python3 with pip and venv, git,
  curl, node and npm;
- `code-interpreter-v1` (e2b_code_interpreter's default, dsec's `code-interpreter`): the data
  stack (numpy, pandas, scikit-learn, seaborn, matplotlib figures as PNG results) and kernels
  for python, javascript, bash and r; a language without one (java) is refused naming those.

Both images are built here (module fixtures, from the node's debootstrap cache that
scripts/install-extras.sh fills) rather than in conftest's session `images`: they are large.
"""

from __future__ import annotations

import base64
import time

import pytest


def _built(images, name: str):
    """A built-in image in the test home, with its build time and size in the output."""
    from dsec.images.builtin import ensure_builtin
    t0 = time.monotonic()
    info = ensure_builtin(images, name)
    print(f"{name} image: {time.monotonic() - t0:.1f}s, {info.size_bytes / 2**20:.0f} MiB")
    return info


@pytest.fixture(scope="module")
def base_image(images):
    return _built(images, "e2b-base")


@pytest.fixture(scope="module")
def ci_image(images):
    return _built(images, "code-interpreter")


@pytest.fixture(scope="module")
def ci(e2b_env, ci_image):
    """e2b_code_interpreter's Sandbox.create() with no template: code-interpreter-v1."""
    from e2b_code_interpreter import Sandbox
    sbx = Sandbox.create(timeout=600)
    yield sbx
    sbx.kill()


TOOLS = ("python3 -m pip --version && python3 -m venv /tmp/venv && /tmp/venv/bin/python -c 'print(1)' && "
         "git --version && curl --version && node -e 'console.log(6*7)' && npm --version")


@pytest.mark.parametrize("template", [None, "base"])
def test_base_template_has_pip_git_curl_node_npm(e2b_env, base_image, template):
    from e2b import Sandbox
    sbx = Sandbox.create(template, timeout=300) if template else Sandbox.create(timeout=300)
    try:
        r = sbx.commands.run(TOOLS, timeout=120)
        assert r.exit_code == 0, r
        assert "pip " in r.stdout and "git version" in r.stdout and "curl " in r.stdout
        assert "42\n" in r.stdout
        # a harness's own repo: git works as the sandbox's user (SWE-agent commits and diffs)
        r = sbx.commands.run("cd /tmp && git init -q repo && cd repo && echo a > f && git add f && "
                             "git -c user.email=a@b -c user.name=a commit -qm init && git log --oneline | wc -l")
        assert r.stdout.strip() == "1", r
    finally:
        sbx.kill()


def test_data_stack(ci):
    ex = ci.run_code("import numpy as np, pandas as pd, scipy, sklearn, seaborn\n"
                     "from sklearn.linear_model import LinearRegression\n"
                     "df = pd.DataFrame({'x': np.arange(10.0)}); df['y'] = 3 * df.x + 1\n"
                     "m = LinearRegression().fit(df[['x']], df.y)\n"
                     "round(float(m.coef_[0]), 6), round(float(m.intercept_), 6)")
    assert ex.error is None, ex.error
    assert ex.text == "(3.0, 1.0)"


def _is_png(b64: str | None) -> bool:
    return b64 is not None and base64.b64decode(b64).startswith(b"\x89PNG\r\n\x1a\n")


def test_matplotlib_figures_are_png_results(ci):
    ex = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
    assert ex.error is None, ex.error
    assert len(ex.results) == 1 and _is_png(ex.results[0].png), ex.results
    # a figure as the cell's value, as seaborn draws it
    ex = ci.run_code("import seaborn as sns\nfig = sns.histplot([1, 2, 2, 3]).get_figure()\nfig")
    assert ex.error is None, ex.error
    assert any(_is_png(r.png) for r in ex.results), ex.results


def test_javascript(ci):
    assert ci.run_code("1+1", language="javascript").text == "2"
    assert ci.run_code("let answer = 40; function inc(x) { return x + 1 }", language="javascript").error is None
    assert ci.run_code("inc(answer) + 1", language="javascript").text == "42"      # state kept
    ex = ci.run_code("console.log('out'); console.error('err'); ({a: 1})", language="javascript")
    assert ex.logs.stdout == ["out\n"] and ex.logs.stderr == ["err\n"] and ex.text == "{ a: 1 }"
    err = ci.run_code("null.x", language="javascript").error
    assert err is not None and err.name == "TypeError" and "null" in err.value
    assert ci.run_code("await Promise.resolve(7)", language="javascript").text == "7"
    assert ci.run_code("process.env.K", language="javascript", envs={"K": "v"}).text == "'v'"
    assert ci.run_code("process.env.K", language="javascript").text is None
    # its own context: other state
    ctx = ci.create_code_context(language="javascript")
    assert ctx.language == "javascript"
    assert ci.run_code("typeof answer", context=ctx).text == "'undefined'"


def test_bash(ci):
    def out(code: str, **kw) -> str:
        ex = ci.run_code(code, language="bash", **kw)
        assert ex.error is None, ex.error
        return "".join(ex.logs.stdout)
    assert out("echo $((6*7))") == "42\n"
    out("cd /tmp && N=5")
    assert out("echo $N $PWD") == "5 /tmp\n"                          # state kept
    assert out("echo $K", envs={"K": "v w"}) == "v w\n"
    assert out("echo \"[$K]\"") == "[]\n"


def test_bash_timeout_interrupts_and_keeps_state(ci):
    from e2b import TimeoutException
    ci.run_code("KEEP=yes", language="bash")
    with pytest.raises(TimeoutException):
        ci.run_code("sleep 60", language="bash", timeout=2)
    t0 = time.monotonic()
    assert "".join(ci.run_code("echo $KEEP", language="bash").logs.stdout) == "yes\n"
    assert time.monotonic() - t0 < 15


def test_r(ci):
    # IRkernel shows a value as display_data, not execute_result: a result that is not the
    # main one (Execution.text stays None), as on E2B, whose R kernel is IRkernel too
    def shown(code: str, **kw) -> list[str]:
        ex = ci.run_code(code, language="r", **kw)
        assert ex.error is None, ex.error
        return [r.text for r in ex.results]
    assert shown("1+1") == ["[1] 2"]
    shown("x <- c(1, 2, 3)")
    assert shown("sum(x)") == ["[1] 6"]                                    # state kept
    assert shown("Sys.getenv('K')", envs={"K": "v"}) == ['[1] "v"']
    assert shown("Sys.getenv('K')") == ['[1] ""']


def test_a_language_without_a_kernel_is_refused_naming_those_there_are(ci):
    from e2b import SandboxException
    with pytest.raises(SandboxException) as e:
        ci.run_code("System.out.println(1);", language="java")
    msg = str(e.value)
    assert "400" in msg and "'java'" in msg
    for language in ("python", "javascript", "bash", "r"):
        assert language in msg, msg
    with pytest.raises(SandboxException) as e:
        ci.create_code_context(language="java")
    assert "javascript" in str(e.value)
