"""FnCall's compile cache keys on everything that can change a compiled program and is scoped
per project (through the real session server, real pool containers, gcc).

Before: the key was (language, compiler argv, code, files): a caller's env (SOURCE_DATE_EPOCH,
CPATH, ...) was baked into a binary that the next caller got, across projects, and
`compile.cached` told any caller that someone else had compiled that exact code."""

from __future__ import annotations

import secrets
import time

from conftest import stranger_key
from dsec.sdk.client import Client

# __DATE__ follows SOURCE_DATE_EPOCH (gcc >= 7): the env reaches the binary
DATE_PROG = '#include <stdio.h>\n/* %s */\nint main(void){puts(__DATE__); return 0;}\n'


def gcc_date(epoch: int) -> str:
    t = time.gmtime(epoch)
    return f"{time.strftime('%b', t)} {t.tm_mday:2d} {t.tm_year}"


async def test_a_different_env_is_not_a_cache_hit_and_takes_effect(client):
    code = DATE_PROG % secrets.token_hex(8)
    y1970, y2001 = 0, 31 * 365 * 86400
    first = await client.fncall(code, "c", env={"SOURCE_DATE_EPOCH": str(y1970)})
    assert first.ok and first.stdout.strip() == gcc_date(y1970), first
    other = await client.fncall(code, "c", env={"SOURCE_DATE_EPOCH": str(y2001)})
    assert other.ok and not other.compile.cached, other
    assert other.stdout.strip() == gcc_date(y2001), other       # not the first caller's binary
    again = await client.fncall(code, "c", env={"SOURCE_DATE_EPOCH": str(y1970)})
    assert again.compile.cached and again.stdout.strip() == gcc_date(y1970)   # the cache still works


async def test_projects_never_share_a_compile_cache_entry(client, server):
    key = stranger_key(server, "cache")
    code = '#include <stdio.h>\n/* %s */\nint main(void){puts("hi"); return 0;}\n' % secrets.token_hex(8)
    mine = await client.fncall(code, "c")
    assert (await client.fncall(code, "c")).compile.cached          # the root project's own entry
    async with Client(server.url, key) as theirs:
        r = await theirs.fncall(code, "c")
        assert r.ok and r.stdout == "hi\n"
        assert not r.compile.cached, "another project's compiled program (and the fact that it exists) leaked"
        assert (await theirs.fncall(code, "c")).compile.cached      # its own entry from now on
    assert mine.ok
