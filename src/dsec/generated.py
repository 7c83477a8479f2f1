"""Checked-in files generated from code (the agent's protocol.h, docs/settings.md): one way to
write them and to check them in tests (`--check`: exit 1 and a diff when the file is stale)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path


def write_or_check(target: Path, text: str, command: str, argv: list[str]) -> int:
    """Write `text` to `target`, or with `--check` in argv only compare: 0 when current, 1 (the
    diff on stdout, `command` to regenerate on stderr) when not."""
    if "--check" in argv:
        current = target.read_text() if target.exists() else ""
        if current == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                                   str(target), "generated"))
        print(f"\n{target} is stale: run `{command}`", file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    print(f"wrote {target}")
    return 0
