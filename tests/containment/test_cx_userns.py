"""The user namespace of every container sandbox (backends/container/idmap.py, nsexec.c):
root inside is an unprivileged host uid of a range no other live sandbox has, and the
namespace gives nothing a root without it would not have."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from dsec.backends.container.idmap import RANGE, IdRanges

from containment._util import pids_by_sandbox, py, sh


def id_base(server, sb) -> int:
    cfg = json.loads((server.paths.sandboxes / sb.id / "config.json").read_text())
    return int(cfg["linux"]["uidMappings"][0]["hostID"])


def host_ids(pid: int) -> tuple[list[int], list[int]]:
    lines = {k: v for k, _, v in (ln.partition(":") for ln in Path(f"/proc/{pid}/status").read_text().splitlines())}
    return [int(x) for x in lines["Uid"].split()], [int(x) for x in lines["Gid"].split()]


async def test_sandbox_root_is_an_unprivileged_host_uid(client, server):
    """Files that root and the default user create inside appear on the host (in the writable layer) as uids of the sandbox's own range, never host root or host uid 1000; every process of the sandbox, the agent included, runs as such a host uid; two sandboxes get disjoint ranges."""
    a = await client.create_container(image="busybox", user="root")
    b = await client.create_container(image="busybox")
    try:
        base_a, base_b = id_base(server, a), id_base(server, b)
        assert base_a >= RANGE and base_b >= RANGE and abs(base_a - base_b) >= RANGE, (base_a, base_b)
        r = await sh(a, "cat /proc/self/uid_map; touch /work/by-root; id -u")
        assert r.stdout.split()[:3] == ["0", str(base_a), str(RANGE)] and r.stdout.split()[-1] == "0", r
        await sh(a, "chown 1000:1000 /work && touch /work/by-user", user="1000")
        upper = server.paths.sandboxes / a.id / "upper" / "work"
        assert (os.stat(upper / "by-root").st_uid, os.stat(upper / "by-root").st_gid) == (base_a, base_a)
        assert os.stat(upper / "by-user").st_uid == base_a + 1000
        # inside, the same files are owned by root and 1000, and image files by root
        r = await sh(a, "stat -c %u:%g /work/by-root /work/by-user /bin/busybox /etc/passwd")
        assert r.stdout.split() == ["0:0", "1000:1000", "0:0", "0:0"], r
        await sh(a, "sleep 30 >/dev/null 2>&1 &")
        pids = pids_by_sandbox()[a.id]
        assert pids
        for pid in pids:
            uids, gids = host_ids(pid)
            assert all(base_a <= u < base_a + RANGE for u in uids + gids), (pid, uids, gids)
    finally:
        await a.stop()
        await b.stop()


def _host_pid_of(sandbox_id: str, inner: int) -> int:
    """The host pid of the sandbox's process `inner` (its pid inside, as `$!` printed it): the
    last NSpid field. Not the largest host pid: pids wrap at pid_max (32768 here) in a long run."""
    for pid in pids_by_sandbox()[sandbox_id]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        ns = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if ns and int(ns[-1]) == inner:
            return pid
    raise AssertionError(f"no process {inner} of {sandbox_id} on the host")


async def test_setuid_root_binary_inside_gives_no_host_root(client, server):
    """A setuid-root binary made by root inside (a copy of busybox, chmod 4755) is setuid to the sandbox's root only: on the host it is owned by the range's base uid, and run by the default user it gains nothing (no_new_privs): the process stays at host uid base+1000."""
    sb = await client.create_container(image="busybox")
    try:
        base = id_base(server, sb)
        await sh(sb, "mkdir /work/s && cp /bin/busybox /work/s/busybox && chmod 4755 /work/s/busybox")
        st = os.stat(server.paths.sandboxes / sb.id / "upper" / "work" / "s" / "busybox")
        assert st.st_uid == base and st.st_mode & 0o4000, (st.st_uid, oct(st.st_mode))
        r = await sh(sb, "/work/s/busybox id -u; /work/s/busybox sleep 30 >/dev/null 2>&1 & echo $!", user=None)
        assert r.stdout.split()[0] == "1000", r
        uids, _ = host_ids(_host_pid_of(sb.id, int(r.stdout.split()[1])))
        assert 0 not in uids and all(u == base + 1000 for u in uids), uids
    finally:
        await sb.stop()


async def test_userns_gives_no_mount_unshare_or_map_writes(attacker):
    """Root's capabilities in the sandbox's own user namespace do not open the kernel's user-namespace surface: unshare/clone of new namespaces, mount (incl. the new mount API), writing uid_map/setgroups, setns back to the owner namespace all fail; CAP_SYS_ADMIN is not in any set; the agent binary (host root) shows as nobody and cannot be changed."""
    for user in ("root", None):
        out = await py(attacker, r'''
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
OUT["unshare_user"] = sc(272, CLONE_NEWUSER)
OUT["unshare_user_ns"] = sc(272, CLONE_NEWUSER | CLONE_NEWNS)
OUT["mount_tmpfs"] = sc(165, b"none", b"/tmp", b"tmpfs", 0, 0)
OUT["fsopen"] = sc(430, b"tmpfs", 0)
OUT["uid_map"] = attempt(lambda: open("/proc/self/uid_map", "w").write("0 0 1\n"))
OUT["setgroups"] = attempt(lambda: open("/proc/self/setgroups", "w").write("allow"))
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
OUT["sys_admin"] = any(int(status[k], 16) & (1 << 21) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
st = os.stat("/.dsec/agent")
OUT["agent_owner"] = st.st_uid
OUT["agent_chmod"] = attempt(os.chmod, "/.dsec/agent", 0o777)
OUT["setuid0_of_agent"] = attempt(os.chown, "/.dsec/agent", 0, 0)
''', user=user)
        for k in ("unshare_user", "unshare_user_ns", "mount_tmpfs", "fsopen"):
            assert out[k] in ("EPERM", "EACCES"), (user, k, out)
        for k in ("uid_map", "setgroups"):        # /proc is a read-only mount (D11)
            assert out[k] in ("EPERM", "EACCES", "EROFS"), (user, k, out)
        assert out["sys_admin"] is False, out
        assert out["agent_owner"] == 65534, out            # host root is not mapped: "nobody"
        assert out["agent_chmod"] != "ok" and out["setuid0_of_agent"] != "ok", out


async def test_pack_diff_carries_in_sandbox_ids(client, server):
    """pack_diff of a user-namespaced sandbox stores the ids seen inside (root 0, user 1000), not the host range: a sandbox started from the layer sees the same owners, under its own range."""
    sb = await client.create_container(image="busybox", user="root")
    name = f"uidpack{os.urandom(3).hex()}@1"
    try:
        await sh(sb, "mkdir -p /work/d && touch /work/d/root-file /work/user-file && "
                     "chown 1000:1000 /work /work/user-file")
        await sb.pack_diff(name)
    finally:
        await sb.stop()
    sb2 = await client.create_container(image="busybox", workspace=name)
    try:
        r = await sh(sb2, "stat -c %u:%g /work/d/root-file /work/user-file /work")
        assert r.stdout.split() == ["0:0", "1000:1000", "1000:1000"], r
    finally:
        await sb2.stop()


async def test_id_ranges_are_persistent_disjoint_and_reclaimed(tmp_path):
    """The host-wide range registry: live claims are never handed out twice (also across registry objects, i.e. an edge restart or a second dsec home); a released range is reusable; a claim whose sandbox directory vanished (a crashed edge) is taken back only when no free slot is left."""
    reg = tmp_path / "reg"
    owners = [tmp_path / f"sb{i}" for i in range(4)]
    for o in owners:
        o.mkdir()
    r1 = IdRanges(reg, first=1 << 20, slots=3)
    a, b = r1.allocate(owners[0]), r1.allocate(owners[1])
    r2 = IdRanges(reg, first=1 << 20, slots=3)            # "restarted edge": same registry
    c = r2.allocate(owners[2])
    assert len({a, b, c}) == 3 and all((x - (1 << 20)) % RANGE == 0 for x in (a, b, c))
    try:
        r2.allocate(owners[3])
        raise AssertionError("a fourth range was handed out of three")
    except Exception as e:
        assert "no free uid range" in str(e), e
    r2.release(b, owners[0])                               # not its owner: nothing happens
    owners[1].rmdir()                                      # owner of b crashed: stale claim
    assert r2.allocate(owners[3]) == b
    r2.release(a, owners[0])
    assert await asyncio.to_thread(r1.allocate, owners[0]) == a
