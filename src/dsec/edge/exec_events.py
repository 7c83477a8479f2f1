"""Agent output -> the wire's ExecEvents."""

from __future__ import annotations

import base64
import codecs
import time
from collections.abc import AsyncIterator

from dsec.agent.client import Exit, Output
from dsec.types import ExecEvent, ExecResult


async def exec_events(exec_id: str, items: AsyncIterator[Output | Exit], t0: float,
                      pty: bool = False) -> AsyncIterator[ExecEvent]:
    """Agent output -> wire events, decoding UTF-8 incrementally so characters never split.
    A terminal's output (pty) is bytes: `pty` events in base64, not kept for the result (a
    terminal runs for long; its followers have had every byte)."""
    decoders = {s: codecs.getincrementaldecoder("utf-8")(errors="replace") for s in ("stdout", "stderr")}
    kept: dict[str, list[str]] = {"stdout": [], "stderr": []}
    async for item in items:
        if pty and isinstance(item, Output):
            if item.data:
                yield ExecEvent(type="pty", data=base64.b64encode(item.data).decode())
            continue
        if isinstance(item, Output):
            text = decoders[item.stream].decode(item.data)
            if text:
                kept[item.stream].append(text)
                yield ExecEvent(type=item.stream, data=text)
            continue
        for s, d in decoders.items():
            rest = d.decode(b"", final=True)
            if rest:
                kept[s].append(rest)
                yield ExecEvent(type=s, data=rest)  # type: ignore[arg-type]
        result = ExecResult(exec_id=exec_id, exit_code=item.exit_code, signal=item.signal,
                            stdout="".join(kept["stdout"]), stderr="".join(kept["stderr"]),
                            timed_out=item.timed_out, truncated=item.truncated,
                            stdout_bytes=item.stdout_total, stderr_bytes=item.stderr_total,
                            session_ended=item.session_ended, duration_s=time.monotonic() - t0)
        yield ExecEvent(type="exit", exec_id=exec_id, result=result)
        return
