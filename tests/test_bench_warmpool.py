"""`dsec bench warmpool` at tiny scale (a burst of 2, 1 one at a time) against the session
server: every mode runs, the warm modes are answered by the pool (through Client.warm_pools /
set_warm_pools and dsec.bench.warm_fill), and the pool is set back to none. No timing
assertions: benchmarks are not timed unit tests."""

from __future__ import annotations

from dsec.bench.warmpool import Opts, bench, markdown, rows


async def test_warmpool_bench_tiny(server, client) -> None:
    # another user's sandbox live on the same server is not the run's leftover (CI 2026-12-05: a
    # sandbox an earlier test left to its TTL was reported as the bench's)
    other = await client.create_container(image="busybox", memory_mb=64, labels={"t": "not-the-bench"})
    o = Opts(burst=2, serial=1, settle_s=0.2)
    auto_before = (await client.warm_pools()).auto_max
    try:
        res = await bench(server, o)
    finally:
        await other.stop()

    assert res["raw_burst"]["n"] == 2 and res["raw_burst"]["failed"] == 0, res["raw_burst"]
    for mode, n in (("cold_burst", 2), ("warm_burst", 2), ("cold_serial", 1), ("warm_serial", 1)):
        m = res[mode]
        assert m["n"] == n and m["failed"] == 0, (mode, m)
        assert 0 < m["p50_ms"] <= m["p99_ms"] and m["create_p50_ms"] > 0, (mode, m)
    assert res["warm_burst"]["claimed"] == 2 and res["warm_serial"]["claimed"] == 1, res
    assert res["pool_fill_s"] > 0
    # the automatic pool (D99): off for the cold rows (nothing claimed there), then burst 1 (8,
    # the smallest burst the node learns from) cold, bursts 2 and 3 from the pool it kept
    assert res["cold_burst"]["claimed"] == 0 and res["cold_serial"]["claimed"] == 0
    assert res["raw_burst_auto"]["n"] == 8 and res["raw_burst_auto"]["failed"] == 0
    assert res["cold_burst_again"]["n"] == 8 and res["cold_burst_again"]["failed"] == 0
    for i, claimed in ((1, 0), (2, 8), (3, 8)):
        m = res[f"auto_burst{i}"]
        assert m["n"] == 8 and m["failed"] == 0 and m["claimed"] == claimed, (i, m)
    assert len(res["auto_fill_s"]) == 2
    assert res["live_left"] == []
    st = await client.warm_pools()
    assert st.pools == {} and st.auto == {}            # set back to none
    assert st.auto_max == auto_before                  # the bound as it was

    assert all(len(r) == 6 for r in rows(res))
    md = markdown(res, o)
    assert "dsec bench warmpool --burst 2 --serial 1" in md and "automatic pool, burst 2" in md
