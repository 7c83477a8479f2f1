"""Heavy image work does not hold up sandbox creation (through the real server).

Before: 8 concurrent pack_diffs of 60k files each ran on the default thread pool (6 threads on
2 cores) that creation's steps also use, so an unrelated create waited 54 s for them (here,
with 6k files each: ~17 s). Now pack_diff runs in the node's own bounded lane
(images/service.py HeavyWork) and a create takes ~0.1 s meanwhile; the bound is generous."""

from __future__ import annotations

import asyncio
import time

PACKS = 8            # more than the default pool's threads on a 2-core node (min(32, cores + 4))
FILES = 6000         # per sandbox: each pack_diff takes seconds here


async def test_a_create_is_not_held_up_by_concurrent_pack_diffs(client):
    sbs = await asyncio.gather(*(client.create_container(image="busybox", user="root") for _ in range(PACKS)))
    try:
        await asyncio.gather(*(sb.run(f"mkdir /work/d && cd /work/d && seq {FILES} | xargs touch && "
                                      "seq 200 | sed s/^/dir/ | xargs mkdir", check=True) for sb in sbs))
        t0 = time.monotonic()
        packs = [asyncio.create_task(sb.pack_diff(f"heavy-{i}@1", replace=True)) for i, sb in enumerate(sbs)]
        try:
            await asyncio.sleep(1.0)                  # the packs have the worker threads now
            t1 = time.monotonic()
            new = await client.create_container(image="busybox")
            took = time.monotonic() - t1
            r = await new.run("echo up")
            await new.stop()
            assert r.stdout == "up\n"
            busy = sum(not p.done() for p in packs)
        finally:
            layers = await asyncio.gather(*packs)
        total = time.monotonic() - t0
        assert all(lay.layers for lay in layers)
        assert busy > 0, "the pack_diffs ended before the create: make them bigger"
        assert took < 10, f"a create took {took:.1f}s while {busy} pack_diffs ran ({total:.1f}s for all)"
    finally:
        await asyncio.gather(*(sb.stop() for sb in sbs))
