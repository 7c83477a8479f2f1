"""Node identity and `dsec nodes` on a real two-node Ray cluster (one for the module) with two
apiserver replicas on PostgreSQL (issue 28.2, 28.6). Each raylet advertises its dsec node name
as a Ray resource (cluster/names.py):
- a cordoned node gets no placement, through either replica;
- the worker's raylet killed and started again (a new Ray node id) keeps its name: Ray starts
  its edge there (on the port it had), which adopts its sandboxes; they answer, stop works,
  their quota is intact;
- a draining node refuses new sandboxes and lists the ones it still holds (moves nothing);
- a node gone for good is forgotten: its quota and index rows are released; should it come
  back after all, what it still runs is stopped (its quota is gone) and it takes sandboxes again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import NO_PSI_ADMISSION, requires_root

from dsec import Client
from dsec.store import open_db
from dsec.store.sandboxes import SandboxIndex
from dsec.testing.waiting import wait_until
from dsec.types import Conflict, DsecError, Unavailable

pytest.importorskip("ray", reason="cluster mode needs ray: pip install -e '.[cluster]'")

SLOW_S = 180.0      # a raylet and an edge starting on a loaded 2-core box


class Env:
    def __init__(self, local, admins: list[Client], users: list[Client], project: str, db_url: str):
        self.local, self.admins, self.users, self.project, self.db_url = local, admins, users, project, db_url
        self.head = next(n for n, rn in local.nodes.items() if rn is None)
        self.worker = next(n for n, rn in local.nodes.items() if rn is not None)
        self.kept: list = []      # the worker's sandboxes, from one test to the next


@pytest.fixture(scope="module")
async def env(pg_cluster):
    requires_root()
    from dsec.cluster.local import local_cluster

    db_url = pg_cluster.create_database(f"nodes_{time.monotonic_ns()}")
    # the replicas' index upkeep every second: a forgotten node that returns is cleaned up soon
    async with local_cluster(nodes=2, replicas=2, edge_env={**NO_PSI_ADMISSION, "DSEC_INDEX_SYNC_S": "1"},
                             db_url=db_url) as local:
        admins = [Client(url, local.admin_key) for url in local.replica_urls]
        p = await admins[0].create_project("nodes-t", max_sandboxes=20, max_cpu_cores=4, max_memory_mb=4096)
        key = (await admins[0].create_key(p.id)).key
        users = [Client(url, key) for url in local.replica_urls]
        e = Env(local, admins, users, p.id, db_url)
        try:
            yield e
        finally:
            for c in users:
                try:
                    for sb in await c.list():
                        try:
                            await (await c.get(sb.id)).stop()
                        except DsecError:
                            pass
                    break
                except DsecError:
                    continue
            for c in [*admins, *users]:
                await c.close()


def _node(sandbox_id: str) -> str:
    return sandbox_id.removeprefix("sb-").split(".")[0]


async def _state_everywhere(env: Env, node: str, state: str) -> None:
    """Every replica's view says so (GET /v1/nodes reads the same cache placement does)."""
    async def seen() -> bool:
        for c in env.admins:
            if {n.node_id: n.state for n in await c.nodes()}.get(node) != state:
                return False
        return True
    await wait_until(seen, timeout_s=30, every_s=0.2, what=f"{node} {state} on every replica")


async def _used(env: Env) -> int:
    return (await env.admins[0].quota(env.project)).used.sandboxes


async def test_cordon_then_restarted_raylet_keeps_its_name_and_sandboxes(env):
    assert not env.head.startswith("n") or "-" in env.head      # a name, not Ray's id
    await env.admins[0].node_action(env.head, "cordon")
    await _state_everywhere(env, env.head, "cordoned")
    made = [await env.users[i % 2].create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
            for i in range(3)]
    assert {_node(sb.id) for sb in made} == {env.worker}, [sb.id for sb in made]
    assert await _used(env) == 3

    from dsec.cluster.discovery import EDGE_PREFIX, actor_address
    before = await actor_address(EDGE_PREFIX + env.worker)
    # the worker's raylet killed (its edge with it) and started again: a new Ray node id
    await asyncio.to_thread(env.local.kill_node, env.worker)
    env.local.restart_node(env.worker)       # blocks the loop (cluster_utils needs the main thread)

    async def answers():
        try:
            r = await (await env.users[1].get(made[0].id)).run("echo back")
            return r.stdout == "back\n"
        except DsecError:
            return False
    await wait_until(answers, timeout_s=SLOW_S, every_s=1.0, what="the restarted node's sandbox to answer")

    async def healthy_everywhere() -> bool:
        for c in env.admins:
            if not {n.node_id: n.healthy for n in await c.nodes()}.get(env.worker):
                return False
        return True
    await wait_until(healthy_everywhere, timeout_s=SLOW_S, every_s=0.5, what="both replicas to see it back")
    for sb in made:        # same ids, same node, each answers through either replica
        assert (await (await env.users[0].get(sb.id)).run("echo ok")).stdout == "ok\n"
    after = await actor_address(EDGE_PREFIX + env.worker)
    assert after["ray_node"] != before["ray_node"] and after["home"] == before["home"]
    assert after["url"] == before["url"]                   # the edge's port kept in its home
    assert await _used(env) == 3                           # quota held by the adopted sandboxes
    await (await env.users[0].get(made[0].id)).stop()      # stop works (old code: 404)
    assert await _used(env) == 2
    env.kept = made[1:]


async def test_drain_refuses_creates_and_lists_what_remains(env):
    assert env.kept, "needs the previous test"
    drained = await env.admins[1].node_action(env.worker, "drain")
    assert drained["state"] == "draining"
    assert sorted(drained["sandboxes"]) == sorted(sb.id for sb in env.kept)
    await _state_everywhere(env, env.worker, "draining")
    for c in env.users:       # the head cordoned, the worker draining: nowhere to go
        with pytest.raises(Unavailable) as e:
            await c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
        assert env.worker in str(e.value) and e.value.field == "node"
    for sb in env.kept:       # nothing moved or stopped
        assert (await (await env.users[1].get(sb.id)).run("echo here")).stdout == "here\n"
    await env.admins[0].node_action(env.head, "uncordon")
    await _state_everywhere(env, env.head, "active")
    new = [await env.users[i % 2].create_container(image="busybox", memory_mb=64, cpu_cores=0.1) for i in range(2)]
    assert {_node(sb.id) for sb in new} == {env.head}
    for sb in new:
        await sb.stop()


async def test_forget_a_removed_node_releases_quota_and_index_rows(env):
    assert env.kept, "needs the previous tests"
    with pytest.raises(Conflict):       # it still answers
        await env.admins[0].node_action(env.worker, "forget")
    before = await _used(env)
    await asyncio.to_thread(env.local.kill_node, env.worker)     # gone for good

    async def forgotten():
        try:
            return await env.admins[0].node_action(env.worker, "forget")
        except Conflict:        # until discovery has dropped it (Ray declares the raylet dead)
            return None
    out = await wait_until(forgotten, timeout_s=60, every_s=0.5, what="the dead node to be forgettable")
    assert out["released"] == len(env.kept) and out["ended"] == len(env.kept), out
    assert await _used(env) == before - len(env.kept) == 0
    db = open_db(env.db_url)
    try:
        index = SandboxIndex(db)
        assert index.list(None, node=env.worker) == []
        assert {index.get(sb.id).state for sb in env.kept} == {"forgotten"}
    finally:
        db.close()
    # the other replica reads node states at most every second (D55): it drops the node soon
    async def gone_at_the_other_replica():
        return env.worker not in {n.node_id for n in await env.admins[1].nodes()}
    await wait_until(gone_at_the_other_replica, timeout_s=15, every_s=0.5, what="replica 1 to drop the forgotten node")
    assert not {sb.id for sb in env.kept} & {s.id for s in await env.users[1].list()}


async def test_a_forgotten_node_that_returns_runs_nothing_stale(env):
    """Its raylet started again under its name: Ray starts its edge, which adopts the sandboxes
    forget gave up; a replica's index upkeep stops them and makes the node active again."""
    assert env.kept, "needs the previous tests"
    env.local.restart_node(env.worker)       # blocks the loop (cluster_utils needs the main thread)

    async def clean_and_active():
        for c in env.admins:
            n = {n.node_id: n for n in await c.nodes()}.get(env.worker)
            if n is None or not n.healthy or n.state != "active" or n.sandboxes:
                return False
        return True
    await wait_until(clean_and_active, timeout_s=SLOW_S, every_s=0.5, what="the returned node emptied and active")
    for sb in env.kept:
        with pytest.raises(DsecError):
            await (await env.users[0].get(sb.id)).run("true")
    assert await _used(env) == 0          # released once, by forget; the stops released nothing more
    await env.admins[0].node_action(env.head, "cordon")
    await _state_everywhere(env, env.head, "cordoned")
    sb = await env.users[1].create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
    assert _node(sb.id) == env.worker
    await sb.stop()
    assert await _used(env) == 0


async def test_rotate_secret_drops_no_request_and_retires_the_old_one(env):
    """Issue 28.4 (its secret part): the secret is a file on each node, read per request; a
    rotation under load refuses nothing, and afterwards the edges refuse the old secret."""
    import httpx

    from dsec.cluster import ray_cluster as rc
    from dsec.cluster.discovery import EDGE_PREFIX, actor_address
    from dsec.cluster.secret_file import SecretFile

    settings = env.local.settings
    node_file = settings.node_homes / rc.NODE_SECRET_FILE
    old = SecretFile(node_file).current()
    sbs = [await env.users[i].create_container(image="busybox", memory_mb=64, cpu_cores=0.1) for i in range(2)]
    failures: list[str] = []
    stop = asyncio.Event()

    async def load(i: int) -> int:
        n = 0
        while not stop.is_set():
            try:
                r = await (await env.users[i].get(sbs[i].id)).run("echo x")
                assert r.stdout == "x\n"
                n += 1
            except Exception as e:       # noqa: BLE001 - any refusal is the failure measured
                failures.append(f"{type(e).__name__}: {e}")
        return n
    tasks = [asyncio.create_task(load(i)) for i in range(2)]
    try:
        out = await rc.rotate_secret(settings)
    finally:
        stop.set()
        done = await asyncio.gather(*tasks)
    assert out["rotated"] and not failures, failures
    assert all(done), done
    new = SecretFile(node_file).current()
    assert new != old and SecretFile(node_file).accepted() == [new]
    assert (settings.home / rc.SECRET_FILE).read_text().strip() == new
    url = (await actor_address(EDGE_PREFIX + env.head))["url"]
    from dsec.cluster import cluster_ca     # the edge serves TLS: verified as a replica does (its node name)
    tls = cluster_ca.client_context(settings.node_homes / cluster_ca.CA_CERT)
    async with httpx.AsyncClient(timeout=30, verify=tls) as http:
        for secret, want in ((old, 401), (new, 200)):
            r = await http.post(f"{url}/v1/edge/status", content=b"{}", headers={"Authorization": f"Bearer {secret}"},
                                extensions={"sni_hostname": env.head})
            assert r.status_code == want, (want, r.text)
    for sb in sbs:
        assert (await (await env.users[0].get(sb.id)).run("echo after")).stdout == "after\n"
        await sb.stop()


async def test_a_raylet_without_a_name_gets_no_edge(env):
    """Ray ids never name a node: `up` leaves an unnamed raylet out and says how to name it."""
    from dsec.cluster import ray_cluster as rc
    from dsec.cluster.discovery import EDGE_PREFIX, named_actors

    before = set(await asyncio.to_thread(named_actors, EDGE_PREFIX))
    extra = env.local.ray_cluster.add_node(num_cpus=1, resources={"dsec_edge": 1})
    try:
        st = await rc.up(env.local.settings)
        assert st["unnamed_ray_nodes"]["ray_node_ids"] == [extra.node_id]
        assert "node-resources" in st["unnamed_ray_nodes"]["fix"]
        assert set(await asyncio.to_thread(named_actors, EDGE_PREFIX)) == before
        assert {n.node_id for n in await env.admins[0].nodes()} <= {env.head, env.worker}
    finally:
        env.local.ray_cluster.remove_node(extra)


def _mounts_under(path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [m for m in (line.split()[4] for line in f) if m == str(path) or m.startswith(f"{path}/")]


async def test_a_home_left_under_a_stale_identity_is_cleared_at_up_and_a_served_one_is_not(env, tmp_path_factory):
    """A host's home under an old Ray-id name (an edge before D55) with a live sandbox and its
    quota and index row in the control store: `cluster up` destroys it (no process, mount,
    cgroup or lxcfs left; quota released, index row `forgotten`) and moves the home aside. A
    home beside it that a live process serves (its lock held) is left alone and answers. A
    down named node's home is only reported, until `dsec nodes forget`; the next `up` clears it."""
    import ipaddress
    import shutil
    import signal
    import subprocess

    from conftest import ServerProc, side_home

    from dsec.backends.container.cgroups import leftover_dirs
    from dsec.backends.container.lxcfs import Lxcfs
    from dsec.backends.container.spec import cgroup_path
    from dsec.cluster import ray_cluster as rc
    from dsec.cluster.actors import seed_native_helpers
    from dsec.cluster.names import bridge_name
    from dsec.iam import IAM
    from dsec.testing.isolated import cleanup_home

    settings = env.local.settings
    root = settings.node_homes
    spare = list(ipaddress.ip_network(settings.subnet_pool).subnets(new_prefix=settings.subnet_prefix))[-3:]
    # a named node that is down (it had a subnet): its home is only reported until it is forgotten
    (root / "gone-node" / "sb").mkdir(parents=True)
    db = open_db(env.db_url)
    try:
        from dsec.store.nodes import NodeRegistry
        assert NodeRegistry(db).assign_subnet("gone-node", [str(spare[2])]) == str(spare[2])
    finally:
        db.close()
    servers: dict[str, ServerProc] = {}
    for name, subnet in (("n0123456789ab", spare[0]), ("held-elsewhere", spare[1])):
        home = root / name
        built = side_home(env.local.homes[0], tmp_path_factory, name)    # the cluster's busybox
        shutil.move(str(built), str(home))
        seed_native_helpers(Path(settings.seed_bin), home / "bin")
        servers[name] = ServerProc(home, {"DSEC_VM": "0", "DSEC_NET_BRIDGE": bridge_name(name),
                                          "DSEC_NET_SUBNET": str(subnet), "DSEC_LOG_LEVEL": "WARNING"},
                                   args=("--node-id", name))
        await asyncio.to_thread(servers[name].start, SLOW_S)
    stale, held = servers["n0123456789ab"], servers["held-elsewhere"]
    moved: list[Path] = []
    try:
        async with stale.client() as c:
            sb = await c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
            await sb.run("(sleep 3600 &)")
        async with held.client() as c:
            kept = await c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
        # as the cluster knew it before the upgrade: its quota held, its index row live
        iam = IAM(env.db_url, home=settings.home)
        try:
            before = iam.quotas.quota(env.project).used.sandboxes
            iam.quotas.activate(iam.quotas.reserve(env.project, 0.1, 64), sb.id)
            SandboxIndex(iam.db).upsert(sb.id, "n0123456789ab", env.project, "running")
        finally:
            iam.close()
        lxcfs_pid = Lxcfs(stale.home / "lxcfs").pid()
        assert lxcfs_pid is not None and leftover_dirs(cgroup_path(sb.id))
        stale.kill(signal.SIGTERM)            # the old edge gone; its sandbox runs on
        assert subprocess.run(["crun", "--root", str(stale.paths.crun_root), "list", "-q"],
                              capture_output=True, text=True).stdout.split() == [sb.id]

        st = await rc.up(settings)
        cleared = {x["node"]: x for x in st.get("stale_homes", {}).get("cleared", [])}
        assert set(cleared) == {"n0123456789ab"}, st.get("stale_homes")
        out = cleared["n0123456789ab"]
        moved.append(Path(out["moved_to"]))
        assert out["stopped"] == [sb.id] and out["released"] == 1 and out["ended"] == 1, out
        assert not stale.home.exists() and moved[0].parent == root / ".stale"
        kept_homes = {x["node"]: x for x in st["stale_homes"]["kept"]}
        assert set(kept_homes) == {"gone-node"} and "dsec nodes forget gone-node" in kept_homes["gone-node"]["fix"]
        # nothing of it runs or stays mounted: containers, cgroups, lxcfs, mounts
        assert not leftover_dirs(cgroup_path(sb.id))
        assert not _mounts_under(stale.home) and not _mounts_under(moved[0])

        async def lxcfs_gone() -> bool:       # SIGKILLed; gone once init has reaped it
            return not Path(f"/proc/{lxcfs_pid}").exists()
        await wait_until(lxcfs_gone, timeout_s=30, every_s=0.2, what="the stale home's lxcfs to exit")
        assert subprocess.run(["crun", "--root", str(moved[0] / "crun"), "list", "-q"],
                              capture_output=True, text=True).stdout.split() == []
        db = open_db(env.db_url)
        try:
            assert SandboxIndex(db).get(sb.id).state == "forgotten"
        finally:
            db.close()
        async with Client(env.local.replica_urls[0], env.local.admin_key) as admin:
            assert (await admin.quota(env.project)).used.sandboxes == before
        # the served home: untouched, and its sandbox answers
        assert held.home.exists() and "held-elsewhere" not in str(st["stale_homes"])
        async with held.client() as c:
            assert (await (await c.get(kept.id)).run("echo here")).stdout == "here\n"
        async with Client(env.local.replica_urls[0], env.local.admin_key) as admin:
            await admin.node_action("gone-node", "forget")        # the operator's word: it is gone
        again = (await rc.up(settings))["stale_homes"]
        assert [x["node"] for x in again["cleared"]] == ["gone-node"] and not again["kept"], again
        moved.append(Path(again["cleared"][0]["moved_to"]))
        assert (await rc.up(settings)).get("stale_homes") is None     # nothing left to clear
    finally:
        for s in servers.values():
            s.kill(signal.SIGTERM)
            cleanup_home(s.home)
        for m in [*moved, root / "gone-node"]:
            cleanup_home(m)
