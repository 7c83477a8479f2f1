"""End reasons (issue 26.3): code in a sandbox cannot make its own end look like the
infrastructure's. The edge tells `host_pressure` from `oom_killed` by the sandbox's memory
cgroup counters (its OOM kills, its high-water mark against its own limit): the sandbox cannot
reset or rewrite them, nor mount a cgroup tree of its own. It cannot kill its agent (the
sandbox's init) either, which would end it as `agent_died`: signals from inside a pid namespace
do not reach its init. (A sandbox can still spend its own memory_mb: that ends `oom_killed`,
which docs/events.md tells a trainer to check when it wants to penalise it.)"""

from __future__ import annotations

from containment._util import cgroup_file, py


async def test_sandbox_cannot_fake_its_end_reason(server, cx):
    sb = await cx.create_container(image="debian-python", memory_mb=64)
    try:
        await sb.run("head -c 20000000 /dev/zero > /dev/shm/peak && rm /dev/shm/peak")   # a high-water mark
        peak = int(cgroup_file(sb.id, "memory", "memory.max_usage_in_bytes").read_text())
        limit = int(cgroup_file(sb.id, "memory", "memory.limit_in_bytes").read_text())
        out = await py(sb, """
base = "/sys/fs/cgroup/memory" if os.path.isdir("/sys/fs/cgroup/memory") else "/sys/fs/cgroup"
for name, value in (("memory.max_usage_in_bytes", "0"), ("memory.limit_in_bytes", "9999999999"),
                    ("memory.memsw.max_usage_in_bytes", "0"), ("memory.oom_control", "1"),
                    ("memory.failcnt", "0"), ("memory.max", "max"), ("memory.peak", "reset")):
    def w(p=os.path.join(base, name), v=value):
        with open(p, "w") as f:
            f.write(v)
    OUT[name] = attempt(w)
os.makedirs("/tmp/cg", exist_ok=True)
OUT["mount"] = sc(165, b"cgroup", b"/tmp/cg", b"cgroup", 0, b"memory")
OUT["mount2"] = sc(165, b"cgroup2", b"/tmp/cg", b"cgroup2", 0, 0)
for sig in (9, 15, 6, 11, 2, 1, 10):
    OUT[f"kill1-{sig}"] = sc(62, 1, sig)
""")
        assert all(v != "ok" for k, v in out.items() if not k.startswith("kill1-")), out
        assert int(cgroup_file(sb.id, "memory", "memory.max_usage_in_bytes").read_text()) >= peak
        assert int(cgroup_file(sb.id, "memory", "memory.limit_in_bytes").read_text()) == limit
        # signals to its init from inside: delivered or not, the agent lives on
        r = await sb.run("echo alive")
        assert r.stdout.strip() == "alive", (r, out)
        assert (await sb.refresh()).state.value == "running"
    finally:
        await sb.stop()
