"""The agent protocol is declared once (dsec/agent/protocol.py): the C agent's numbers come from
the header generated from it, checked in and kept current (issue 23, item 4)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dsec.agent import gen_header
from dsec.agent import protocol as P
from dsec.agent.build import SOURCE, source_files

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_in_header_is_current() -> None:
    p = subprocess.run([sys.executable, "-m", "dsec.agent.gen_header", "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, f"regenerate with `python -m dsec.agent.gen_header`:\n{p.stdout}{p.stderr}"


def test_every_type_and_tag_reaches_the_c_side() -> None:
    header = gen_header.TARGET.read_text()
    for m in P.MsgType:
        assert re.search(rf"\bT_{m.name} = {int(m.value)},", header), m
    for t in P.Tag:
        assert re.search(rf"\bF_{t.name} = {int(t.value)},", header), t
    assert f"#define PROTO_VERSION {P.PROTOCOL_VERSION}u" in header


def test_the_c_source_declares_no_wire_numbers_of_its_own() -> None:
    """Nothing but the generated header defines a frame type, a field tag or the version."""
    for f in source_files():
        if f.name == "protocol.h":
            continue
        text = f.read_text()
        assert not re.search(r"\bT_EXEC\s*=|\bF_CMD\s*=|#define\s+(PROTO_VERSION|HDR|MAX_PAYLOAD)\b", text), f
    assert '#include "protocol.h"' in (SOURCE.parent / "agent" / "base.c").read_text()


def test_a_stale_header_is_caught(tmp_path, monkeypatch) -> None:
    target = tmp_path / "protocol.h"
    target.write_text(gen_header.generate().replace("T_CREDIT = 17", "T_CREDIT = 18"))
    monkeypatch.setattr(gen_header, "TARGET", target)
    assert gen_header.main(["--check"]) == 1
