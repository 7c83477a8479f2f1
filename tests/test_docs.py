"""The shell blocks of README.md and docs/*.md, run as a reader would run them (issue 23, item 10:
docs that were wrong when followed).

Every ```bash (or sh/shell) block either runs here or is preceded by a line
`<!-- not-run: REASON -->`. Each document's blocks run in order, with `bash -e` in a temp dir,
against a dsec server of its own (a fresh project tree: README's keys and projects do not meet
tenancy.md's), as a reader following that one page on a machine with the defaults. The docs
name those defaults and the test points them at its server: `http://127.0.0.1:7620` is the
server's URL, `/var/lib/dsec` its DSEC_HOME; DSEC_URL, DSEC_API_KEY and DSEC_HOME are set as
the CLI reads them, and `dsec`/`python3` are this checkout's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(bash|sh|shell|console)\s*$")
NOT_RUN = re.compile(r"^\s*<!-- not-run: (\S.{9,}) -->\s*$")   # a reason of 10 characters at least
DEFAULT_URL, DEFAULT_HOME = "http://127.0.0.1:7620", "/var/lib/dsec"
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    path: Path
    line: int              # of the opening fence, 1-based
    text: str
    not_run: str | None    # the reason, when marked

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m.group(1)), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: the block is never closed")
        marker = NOT_RUN.match(lines[start - 1]) if start else None
        blocks.append(Block(path, start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i += 1
    return blocks


ALL = [b for p in DOCS for b in shell_blocks(p)]
RUN = [b for b in ALL if b.not_run is None]


def test_every_block_runs_or_says_why_not():
    """A `not-run` marker must sit right before a shell block (a stray one, or one before a
    blank line, marks nothing), and a not-run is rare enough to be read."""
    stray = []
    for p in DOCS:
        lines = p.read_text().splitlines()
        for n, line in enumerate(lines):
            if "not-run" in line and not (NOT_RUN.match(line) and n + 1 < len(lines) and FENCE.match(lines[n + 1])):
                stray.append(f"{p.relative_to(ROOT)}:{n + 1}: {line.strip()}")
    assert not stray, "not-run markers that mark no shell block (or have no reason):\n" + "\n".join(stray)
    assert len(RUN) >= 5, [b.where for b in RUN]     # the docs keep showing the product working


@pytest.fixture(scope="module")
def doc_servers(dsec_home, images, tmp_path_factory):
    """One server per document, started when its first block runs."""
    from conftest import ServerProc, _cleanup_home, side_home
    servers: dict[Path, ServerProc] = {}

    def get(doc: Path) -> ServerProc:
        if doc not in servers:
            srv = servers[doc] = ServerProc(side_home(dsec_home, tmp_path_factory, "docs"))
            srv.start()
        return servers[doc]
    yield get
    for srv in servers.values():
        srv.kill()
        _cleanup_home(srv.home)


def as_run_here(text: str, url: str, home: Path) -> str:
    return text.replace(DEFAULT_URL, url).replace(DEFAULT_HOME, str(home))


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_block_runs(block: Block, doc_servers):
    srv = doc_servers(block.path)
    bin_dir = str(Path(sys.executable).parent)     # `dsec` and `python3` of this checkout's venv
    env = {**os.environ, "DSEC_HOME": str(srv.home), "DSEC_URL": srv.url, "DSEC_API_KEY": srv.key,
           "PYTHONPATH": str(ROOT / "src"), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    for k in ("E2B_DEBUG", "E2B_DOMAIN", "COLUMNS"):      # a reader's shell has none of these set
        env.pop(k, None)
    script = as_run_here(block.text, srv.url, srv.home)
    with tempfile.TemporaryDirectory(prefix="dsec-doc-") as cwd:
        p = subprocess.run(["bash", "-e"], input=script, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=BLOCK_TIMEOUT_S)
    print(f"--- {block.where}\n{p.stdout}")
    assert p.returncode == 0, (f"{block.where}: exit {p.returncode}\n--- script\n{script}--- stdout\n"
                               f"{p.stdout[-3000:]}--- stderr\n{p.stderr[-3000:]}")
