"""A PTY asked of a sandbox whose agent predates PTYs (the stub speaks protocol 1, as agents of
sandboxes made before do): refused by name, before anything runs (issue 24 item 5)."""

from __future__ import annotations

import pytest

from dsec.edge.edge import Edge
from dsec.types import Conflict, ContainerArgs, ExecRequest, PtySize


async def test_old_agents_are_refused_a_pty_naming_the_fix(edge: Edge):
    sb = (await edge.create("p", ContainerArgs(image="busybox"))).id
    req = ExecRequest(cmd="sh", pty=PtySize(cols=80, rows=24))
    with pytest.raises(Conflict, match="before dsec had PTYs") as e:
        await edge.exec_start(sb, req)
    assert e.value.field == "pty" and "new sandbox" in (e.value.fix or "")
    with pytest.raises(Conflict, match="before dsec had PTYs"):
        async for _ in edge.exec_stream(sb, req):
            pass
    assert (await edge.run(sb, ExecRequest(cmd="echo plain"))).stdout == "plain\n"   # the rest works
    assert await edge.list_execs(sb) == []
