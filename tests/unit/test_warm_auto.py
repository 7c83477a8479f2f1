"""The automatic warm pools' sizing (edge/warm_auto.py, D99): what makes a burst, how big its
pool is, the bound over all images, the end after the quiet period, the drop and its pause.
Clock values are passed in: no sleeping, no timing."""

from __future__ import annotations

from dsec.edge.warm_auto import GAP_S, MIN_BURST, AutoPools


def burst(a: AutoPools, image: str, key: object, n: int, t0: float, step: float = 0.05) -> bool:
    changed = False
    for i in range(n):
        changed |= a.observe(image, key, now=t0 + i * step)
    return changed


def test_a_burst_of_eight_makes_a_pool_of_its_size_under_the_bound():
    a = AutoPools(max_total=20, idle_s=60)
    assert not burst(a, "busybox", "k", MIN_BURST - 1, 0.0)
    assert a.pools == {}
    assert a.observe("busybox", "k", now=1.0)
    assert a.pools["busybox"].size == MIN_BURST
    burst(a, "busybox", "k", 30, 1.1)                  # the same burst goes on: the pool grows, capped
    assert a.pools["busybox"].size == 20 and a.pools["busybox"].burst == 38
    # a second image gets what the bound leaves: nothing
    assert not burst(a, "debian-python", "d", 10, 2.0)
    assert "debian-python" not in a.pools


def test_creates_far_apart_are_no_burst_and_off_means_off():
    a = AutoPools(max_total=20, idle_s=60)
    for i in range(20):
        a.observe("busybox", "k", now=i * (GAP_S + 0.1))
    assert a.pools == {}
    off = AutoPools(max_total=0, idle_s=60)
    assert not burst(off, "busybox", "k", 50, 0.0) and off.pools == {}


def test_another_shape_of_the_same_image_does_not_take_its_pool():
    a = AutoPools(max_total=64, idle_s=60)
    burst(a, "busybox", "k1", 10, 0.0)
    assert not burst(a, "busybox", "k2", 30, 0.1)
    assert a.pools["busybox"].key == "k1" and a.pools["busybox"].size == 10
    a.not_poolable("busybox")                          # the image's pool key is not k1's
    assert a.pools == {}
    assert not burst(a, "busybox", "k1", 10, 5.0)      # that shape is not pooled again


def test_it_ends_after_the_quiet_period_and_a_burst_renews_it():
    a = AutoPools(max_total=64, idle_s=60)
    burst(a, "busybox", "k", 10, 0.0)
    assert not a.expire(now=50.0)
    burst(a, "busybox", "k", 8, 50.0)                  # the next step's burst (claims count too)
    assert not a.expire(now=100.0) and "busybox" in a.pools
    assert a.expire(now=111.0) and a.pools == {}


def test_a_drop_ends_every_pool_and_pauses_them_until_the_operator_sets_the_bound():
    a = AutoPools(max_total=64, idle_s=60)
    burst(a, "busybox", "k", 10, 0.0)
    burst(a, "debian-python", "d", 10, 0.0)
    assert a.drop_all("a create was refused", now=1.0)
    assert a.pools == {} and a.dropped == "a create was refused"
    assert not burst(a, "busybox", "k", 20, 2.0) and a.pools == {}   # paused for idle_s
    assert burst(a, "busybox", "k", 10, 62.0)                        # ... and then made again
    a.drop_all("again", now=80.0)
    a.set_max(16)                                                     # the operator's setting ends the pause
    assert a.status(now=81.0)["auto_off_s"] == 0 and burst(a, "busybox", "k", 20, 82.0)
    assert a.pools["busybox"].size == 16
    a.set_max(4)
    assert a.pools["busybox"].size == 4
    a.set_max(0)
    assert a.pools == {} and not a.on


async def test_a_create_short_of_memory_calls_on_short_once_before_it_waits():
    """admit_wait's hook: the edge drops its automatic pools when a create would wait for memory
    (their memory then counts for it at the next check)."""
    from dsec.edge import admit_wait
    from dsec.edge.admission import MemoryShort
    from dsec.types import NodeCapacity, NodeStatus

    class Probe:
        def read(self):
            return type("Read", (), {"mem_available_mb": None})()

    class Short:            # short twice, then room
        calls = 0
        sandbox_mb = 0
        mem_reserve_mb = 0
        probe = Probe()

        def admit(self, status, cpu, mem, held_mb=0):
            self.calls += 1
            if self.calls <= 2:
                raise MemoryShort("short", field="memory_mb")

    class Reclaiming:
        squeezed = 0

        def squeeze(self) -> bool:
            return True

    async def status() -> NodeStatus:
        return NodeStatus(node_id="n", healthy=True, backends=[],
                          capacity=NodeCapacity(cpu_cores=1, memory_mb=1, max_sandboxes=1))
    dropped: list[int] = []
    waited = await admit_wait.admit(Short(), status, Reclaiming(), 1, 256, 5.0,   # type: ignore[arg-type]
                                    on_short=lambda: dropped.append(1))
    assert dropped == [1] and waited > 0
