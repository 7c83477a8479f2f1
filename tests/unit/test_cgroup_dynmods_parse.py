"""cgroups.favors_dynmods / dynmods_problem read mountinfo's super options (D92)."""

from dsec.backends.container import cgroups

HYBRID = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu
43 31 0:40 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""
ON = HYBRID.replace("rw,nsdelegate", "rw,nsdelegate,favordynmods")
FEATURES = "nsdelegate\nfavordynmods\nmemory_localevents\n"


def test_options_of_cgroup_mounts_only():
    opts = cgroups.cgroup_mount_options(HYBRID)
    assert opts == {"/sys/fs/cgroup/cpu": ["rw", "cpu"], "/sys/fs/cgroup/unified": ["rw", "nsdelegate"]}


def test_on_when_any_hierarchy_has_it():
    assert not cgroups.favors_dynmods(HYBRID)
    assert cgroups.favors_dynmods(ON)


def test_a_problem_only_where_the_kernel_has_it_and_it_is_off():
    msg = cgroups.dynmods_problem(FEATURES, HYBRID)
    assert msg is not None and "favordynmods" in msg
    assert cgroups.dynmods_problem(FEATURES, ON) is None
    assert cgroups.dynmods_problem("nsdelegate\n", HYBRID) is None    # kernel < 6.1: nothing to do
