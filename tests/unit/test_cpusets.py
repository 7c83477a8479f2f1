"""Placement of sandboxes on CPUs (backends/container/cpusets.py, D50): ceil(cores) CPUs, the
least loaded; fractional cores count as one; thousands of 1-core sandboxes on 2 CPUs spread."""

from __future__ import annotations

from dsec.backends.container.cpusets import CpuSets, cpu_count_for, parse_list, to_list


def test_count_is_ceil_of_cores_within_the_host():
    assert [cpu_count_for(c, 4) for c in (0.005, 0.5, 1, 1.01, 2, 3.5, 16)] == [1, 1, 1, 2, 2, 4, 4]


def test_lists_round_trip():
    assert parse_list("0-2,5\n") == [0, 1, 2, 5] and to_list([5, 0, 2, 1]) == "0,1,2,5"


def test_thousands_of_one_core_sandboxes_spread_over_two_cpus():
    s = CpuSets([0, 1])
    picks = [s.pick(f"sb{i}", 1.0) for i in range(3200)]
    assert picks.count("0") == picks.count("1") == 1600
    assert s.pick("big", 4) == "0,1"               # more cores than the host: every CPU


def test_least_loaded_and_released():
    s = CpuSets([0, 1, 2, 3])
    assert s.pick("a", 2) == "0,1" and s.pick("b", 0.5) == "2" and s.pick("c", 1) == "3"
    assert s.pick("d", 1) == "2"                   # 0.5 on CPU 2 beats 1.0 on 0, 1 and 3
    s.release("a")
    assert s.pick("e", 2) == "0,1"
    s.pick("e", 1)                                 # placed again (a claim): its old place freed
    assert sorted(s.load.values()) == [0.0, 1.0, 1.0, 1.5]
    s.adopt("f", "0-1", 2)                         # an edge restart counts it where it runs
    assert s.load[0] == 2.0 and s.load[1] == 1.0 and "f" in s.held
