"""CompiledFilters (backends/container/seccomp_bpf.py): what it keeps from crun's state dir and
when it annotates a config (D103)."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

from dsec.backends.container.seccomp_bpf import ANNOTATION, STATE_FILE, CompiledFilters

PROFILE = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["acct"], "action": "SCMP_ACT_ERRNO"}]}


def _cfg(profile: dict | None = PROFILE) -> dict:
    return {"linux": {"seccomp": profile} if profile else {}}


def test_learns_once_then_annotates_the_same_profile_only(tmp_path: Path) -> None:
    crun = shutil.which("crun") or "/usr/bin/crun"
    f = CompiledFilters(crun)
    cfg = _cfg()
    assert not f.annotate(cfg) and "annotations" not in cfg and not f.known
    (tmp_path / STATE_FILE).write_bytes(b"\x06\x00\x00\x00\x00\x00\xff\x7f" * 3)
    f.learn(cfg, tmp_path)
    assert f.known
    cfg2 = _cfg()
    assert f.annotate(cfg2)
    assert base64.b64decode(cfg2["annotations"][ANNOTATION]) == (tmp_path / STATE_FILE).read_bytes()
    other = _cfg({**PROFILE, "defaultAction": "SCMP_ACT_KILL"})
    assert not f.annotate(other)                     # another profile compiles afresh
    assert not f.annotate(_cfg(None))                # no seccomp section: nothing to hand over


def test_skips_missing_or_implausible_files_and_annotated_starts(tmp_path: Path) -> None:
    f = CompiledFilters("crun")
    f.learn(_cfg(), tmp_path)                                        # no file
    (tmp_path / STATE_FILE).write_bytes(b"\x00" * 7)                 # not whole instructions
    f.learn(_cfg(), tmp_path)
    (tmp_path / STATE_FILE).write_bytes(b"")
    f.learn(_cfg(), tmp_path)
    assert not f.known
    (tmp_path / STATE_FILE).write_bytes(b"\x00" * 8)
    annotated = {**_cfg(), "annotations": {ANNOTATION: "AAAAAAAAAAA="}}
    f.learn(annotated, tmp_path)                     # started from a kept filter: nothing new to learn
    assert not f.known


def test_another_crun_binary_is_another_key(tmp_path: Path) -> None:
    a, b = tmp_path / "crun-a", tmp_path / "crun-b"
    a.write_bytes(b"a")
    b.write_bytes(b"bb")
    fa, fb = CompiledFilters(str(a)), CompiledFilters(str(b))
    assert fa._key(PROFILE) != fb._key(PROFILE)
