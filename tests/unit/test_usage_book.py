"""How often the edge samples a sandbox's usage (edge/usage.py): every 5 s for a minute after
someone asked, else every 60 s (DSEC_USAGE_IDLE_S=0: only when asked); CPU percent from two samples."""

from __future__ import annotations

from dsec.backends.base import RawUsage
from dsec.edge.usage_book import KEEP, WATCH_FOR_S, UsageBook, to_sample


def _sampled(book: UsageBook, sid: str, at: float) -> None:
    book.track(sid).last_at = at


def test_watched_sandboxes_every_5_s_others_every_60_s() -> None:
    book = UsageBook(5.0, 60.0)
    assert book.due("a", 100.0)                  # never sampled
    _sampled(book, "a", 100.0)
    assert not book.due("a", 110.0) and book.due("a", 160.0)
    book.watch("a", 110.0)
    assert book.due("a", 110.0) and book.watched_count() in (0, 1)
    _sampled(book, "a", 110.0)
    assert not book.due("a", 114.0) and book.due("a", 115.0)
    # the watch lapses a minute after the last ask: back to 60 s
    _sampled(book, "a", 110.0 + WATCH_FOR_S - 1)
    assert not book.due("a", 110.0 + WATCH_FOR_S + 6)


def test_idle_sampling_off() -> None:
    book = UsageBook(5.0, 0.0)
    assert not book.due("a", 100.0)
    book.watch("a", 100.0)
    assert book.due("a", 100.0)


def test_ring_is_bounded_and_cpu_percent_of_the_limit() -> None:
    book = UsageBook()
    t = book.track("a")
    assert t.samples.maxlen == KEEP
    first = RawUsage(cpu_ns=0, mem_bytes=100 << 20, mem_cache=20 << 20, disk_bytes=4096)
    s0 = to_sample(first, None, 0.0, 0.5, 256, 1024)
    assert s0.cpu_used_pct == 0.0 and s0.mem_used == 80 << 20 and s0.mem_total == 256 << 20
    assert s0.cpu_count == 1 and s0.disk_total == 1024 << 20
    # 0.25 s of CPU over 1 s with half a core: 50% of its share
    s1 = to_sample(RawUsage(cpu_ns=250_000_000, mem_bytes=0, mem_cache=0, disk_bytes=None), first, 1.0, 0.5, 256, None)
    assert s1.cpu_used_pct == 50.0 and s1.disk_used == 0 and s1.disk_total == 0


def test_only_watched_sandboxes_are_looked_at_between_full_scans() -> None:
    """The sampler looks at every sandbox only every scan_every_s (10 s, at most the idle
    interval); between, at the watched ones alone (O(watched), not O(sandboxes) a second)."""
    book = UsageBook(5.0, 60.0)
    for i in range(100):
        _sampled(book, f"s{i}", 100.0)
    book.watch("s7", 101.0)
    assert book.watched_ids(102.0) == ["s7"]
    assert book.watched_ids(101.0 + WATCH_FOR_S + 1) == [] and book.watched_count() == 0   # lapsed: dropped
    book.watch("s8", 200.0)
    book.forget("s8")
    assert book.watched_ids(201.0) == []
    assert book.scan_every_s == 10.0
    assert UsageBook(5.0, 1.0).scan_every_s == 1.0 and UsageBook(5.0, 0.0).scan_every_s == 10.0
