"""The processes of a dsec cluster, as Ray actors: one EdgeNode per node (pinned to it) and
stateless ApiReplica(s). Ray places them, restarts a crashed one on its node, and tells who is
alive; sandbox traffic never goes through Ray (apiserver -> edge is HTTP, edge_service.py).

Both run their service in the actor's own event loop (Ray async actors) and start on the first
call of start()/address(), so an actor Ray restarts after a crash serves again as soon as
discovery asks for its address.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket

    from dsec.settings import Settings

log = logging.getLogger("dsec.cluster")


def seed_native_helpers(src: Path, dst: Path) -> None:
    """Copy the compiled helpers (agent, nsexec, BPF object) another home on this host built:
    their names carry their source's hash, so a copy is the same build and an outdated one is
    never used; several edges on one host then skip compiling the same files each."""
    import shutil
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*"):
        if f.is_file() and (f.name.startswith("dsec-") or f.name.endswith(".bpf.o")) and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


class EdgeNode:
    """One node's edge + FnCall, served over HTTP on the node's address (edge_service.py)."""

    def __init__(self, node_id: str, home: str, secret_file: str, system_project: str, host: str,
                 builtin_images: list[str] | None = None, seed_bin: str | None = None,
                 netns: dict[str, str] | None = None, port: int = 0, tls_file: str | None = None):
        """`tls_file`: the node's edge certificate (cluster_ca.py; a path on this node, never the
        key itself); None: plain HTTP (`cluster up --edge-plain-http`)."""
        self.node_id = node_id
        self._tls_file = tls_file
        self._seed_bin = Path(seed_bin) if seed_bin else None
        self.home = Path(home)
        self._secret_file = secret_file    # on this node (secret_file.py): never the secret itself
        self._system_project = system_project
        self._host = host
        self._builtin = list(builtin_images or [])
        self._netns = netns            # EdgeNetns.to_json(): run the edge in the node's own netns
        self._port = port              # 0: the one kept in its home (edge_socket)
        from dsec.settings import Settings
        self._settings = Settings.from_env().with_home(self.home)   # this actor's (Ray gives it edge_env)
        self._stack: AsyncExitStack | None = None
        self._url: str | None = None
        self._child: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def _start(self) -> None:
        if self._netns is not None:
            await self._start_in_netns()
            return
        import ray      # "": this raylet's address (after a restart, maybe not the last one's)
        host = self._host or ray.util.get_node_ip_address()
        self._stack, self._url = await start_edge(self._settings, self.node_id, self._secret_file,
                                                  self._system_project, host, self._builtin, self._seed_bin,
                                                  self._port, self._tls_file)

    async def _start_in_netns(self) -> None:
        """The edge as a child process inside the node's netns (edge_proc.py, D40)."""
        import json
        import sys
        from dsec.cluster import netns
        from dsec.types import Unavailable
        assert self._netns is not None
        ns = netns.EdgeNetns.from_json(self._netns)
        await asyncio.to_thread(netns.ensure, ns)
        # spawned from the actor's event loop thread, which lives as long as the actor
        proc = await asyncio.create_subprocess_exec(
            "nsenter", f"--net={ns.path}", "--", sys.executable, "-m", "dsec.cluster.edge_proc", str(os.getpid()),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)   # the child reads the same environment
        stack = AsyncExitStack()
        stack.push_async_callback(_end_child, proc)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            cfg = {"node_id": self.node_id, "home": str(self.home), "secret_file": self._secret_file,
                   "system_project": self._system_project, "host": ns.ns_ip, "builtin_images": self._builtin,
                   "seed_bin": str(self._seed_bin) if self._seed_bin else None, "port": self._port,
                   "tls_file": self._tls_file}
            proc.stdin.write(json.dumps(cfg).encode() + b"\n")
            await proc.stdin.drain()
            line = await proc.stdout.readline()      # stdin stays open: its end is the actor's death
            if not line:
                raise Unavailable(f"the edge process of {self.node_id} exited ({await proc.wait()}) before serving",
                                  fix="see this Ray worker's log (the edge logs to its stderr)")
            ready = json.loads(line)
        except BaseException:
            await stack.aclose()
            await _release_netns(ns)
            raise
        self._stack, self._url, self._child = stack, ready["url"], proc
        self._watch = asyncio.create_task(self._exit_with_child(proc))
        log.info("edge serving in its network namespace",
                 extra={"node": self.node_id, "url": self._url, "netns": ns.name, "pid": proc.pid})

    async def _exit_with_child(self, proc: asyncio.subprocess.Process) -> None:
        """The edge process died under a live actor: end the actor too, so that Ray restarts it
        on its node (a new edge adopts the sandboxes), as when an in-process edge crashes."""
        code = await proc.wait()
        if self._child is proc:            # not stop()'s doing
            log.error("edge process died; restarting the actor", extra={"node": self.node_id, "exit": code})
            os._exit(1)

    async def address(self) -> dict[str, Any]:
        """{node_id, url, ray_node, home}; starts the edge first if it is not serving."""
        async with self._lock:
            if self._stack is None:
                await self._start()
        import ray
        return {"node_id": self.node_id, "url": self._url, "home": str(self.home), "pid": os.getpid(),
                "subnet": self._settings.network.subnet, "ray_node": ray.get_runtime_context().get_node_id(),
                "edge_pid": self._child.pid if self._child else os.getpid(),
                "netns": self._netns_name()}

    def _netns_name(self) -> str | None:
        if self._netns is None:
            return None
        from dsec.cluster import netns
        return netns.EdgeNetns.from_json(self._netns).name

    async def stop(self) -> None:
        """Close the edge (sandboxes keep running; an edge started on this home adopts them)."""
        async with self._lock:
            stack, self._stack = self._stack, None
            self._child = None
            if stack is not None:
                await stack.aclose()
            if self._netns is not None:
                from dsec.cluster import netns
                await _release_netns(netns.EdgeNetns.from_json(self._netns))


async def _release_netns(ns: Any) -> None:
    """Remove an edge's netns (a netns.EdgeNetns) unless sandboxes are plugged into it: its
    bridge carries their veths, so it is kept for the next edge on this node then."""
    from dsec.cluster import netns
    plugged = await asyncio.to_thread(netns.plugged_sandboxes, ns)
    if plugged:
        log.warning("edge network namespace kept: sandboxes are plugged into it",
                    extra={"netns": ns.name, "veths": len(plugged)})
    else:
        await asyncio.to_thread(netns.remove, ns.node_id)


async def _end_child(proc: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
    """SIGTERM (a clean edge stop), SIGKILL after `grace_s`."""
    if proc.returncode is None:
        try:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), grace_s)
        except ProcessLookupError:
            pass
        except TimeoutError:
            proc.kill()
            await proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()


async def start_edge(settings: Settings, node_id: str, secret_file: str, system_project: str, host: str,
                     builtin_images: list[str], seed_bin: Path | str | None,
                     port: int = 0, tls_file: str | None = None) -> tuple[AsyncExitStack, str]:
    """One node's edge + FnCall served over HTTP on `host` (`port`, else edge_socket's): (what
    stops it, its URL).
    Runs in the EdgeNode actor, or in its child inside the node's netns (edge_proc.py), with the
    settings that process read (its home: the edge's)."""
    from dsec import log as dlog, tracing
    from dsec.cluster.edge_service import edge_app, serve, stop
    from dsec.cluster.secret_file import SecretFile
    from dsec.embedded.server import make_private, node_services
    from dsec.embedded.serverlock import hold_server_lock
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService

    dlog.configure(settings.server.log_level)
    tracing.start(settings.observability, "dsec-edge")     # DSEC_OTLP_ENDPOINT / DSEC_TRACES_FILE
    secrets = SecretFile(secret_file)
    secrets.accepted()           # there and valid, or the start fails saying so
    if tls_file is not None and not os.path.exists(tls_file):
        from dsec.types import Unavailable
        raise Unavailable(f"the edge certificate {tls_file} is missing on node {node_id}", field="edge_tls",
                          fix="run `dsec cluster up` (it issues every live node's certificate), or "
                              "`--edge-plain-http` for plain HTTP on a private network")
    paths = settings.paths
    make_private(paths)
    (paths.home / "cache").mkdir(exist_ok=True)
    if seed_bin is not None:
        seed_native_helpers(Path(seed_bin), paths.bin)
    for name in builtin_images:      # until the shared layer store: each node builds its own
        await asyncio.to_thread(ensure_builtin, ImageService(paths, settings=settings.images), name)
    stack = AsyncExitStack()
    try:
        # as `dsec up` does: a home in use is known by its lock (stale_homes.py never touches it)
        stack.enter_context(hold_server_lock(paths))
        edge, fncall = await stack.enter_async_context(node_services(settings, node_id, system_project))
        sock = edge_socket(paths.home, host, port)
        server = await serve(edge_app(edge, secrets.accepted, fncall), sock, tls_file)
        stack.push_async_callback(stop, server)
    except BaseException:
        await stack.aclose()
        raise
    bound, port = sock.getsockname()[:2]
    url = f"{'https' if tls_file else 'http'}://{bound}:{port}"
    log.info("edge serving", extra={"node": node_id, "url": url, "home": str(paths.home)})
    return stack, url


PORT_FILE = "edge.port"


def edge_socket(home: Path, host: str, port: int = 0) -> "socket.socket":
    """The edge service's socket: on `port` if given (a taken one is an error naming it), else
    on the port kept in <home>/edge.port (a free one the first time, or if it is taken now), which
    is kept: an edge restarted on its node serves where it did."""
    from dsec.cluster.edge_service import bind
    from dsec.types import Unavailable
    kept = home / PORT_FILE
    try:
        if port:
            sock = bind(host, port)
        else:
            want = int(kept.read_text()) if kept.exists() else 0
            try:
                sock = bind(host, want)
            except OSError:
                log.warning("the edge's kept port is taken: binding a free one", extra={"port": want})
                sock = bind(host, 0)
    except OSError as e:
        raise Unavailable(f"the edge cannot listen on {host}:{port}: {e.strerror}", field="edge_port",
                          fix="free the port, or leave --edge-port out (each edge keeps a free one)") from None
    kept.write_text(f"{sock.getsockname()[1]}\n")
    return sock


class ApiReplica:
    """The normal dsec HTTP API over every edge discovery finds (discovery.py)."""

    def __init__(self, name: str, secret_file: str, db_url: str, admin_key_file: str, host: str, port: int,
                 images_home: str | None = None, ca_file: str | None = None):
        """`ca_file`: the cluster CA on this replica's node (cluster_ca.py): edges must serve TLS
        its certificates verify; None: plain HTTP edges (`--edge-plain-http`)."""
        self.name = name
        self._ca_file = ca_file
        self._secret_file = secret_file    # on this replica's node (secret_file.py)
        self._db_url = db_url
        self._admin_key_file = admin_key_file
        self._host, self._port = host, port
        self._images_home = images_home
        self._stack: AsyncExitStack | None = None
        self._url: str | None = None
        self._lock = asyncio.Lock()

    async def _start(self) -> None:
        from dsec import log as dlog, tracing
        from dsec.apiserver.app import create_app
        from dsec.apiserver.context import ApiContext
        from dsec.cluster.discovery import RayDiscovery
        from dsec.cluster.edge_service import bind, serve, stop
        from dsec.config import Paths
        from dsec.iam import IAM
        from dsec.images.service import ImageService
        from dsec.placement import Placer
        from dsec.settings import Settings
        from dsec.watcher import Watcher

        settings = Settings.from_env()      # this replica's (a composition root)
        dlog.configure(settings.server.log_level)
        tracing.start(settings.observability, "dsec-apiserver")   # DSEC_OTLP_ENDPOINT / DSEC_TRACES_FILE
        stack = AsyncExitStack()
        try:
            iam = IAM(self._db_url, home=Path(self._admin_key_file).parent,   # the cluster's home (secrets)
                      db=settings.cluster)
            stack.callback(iam.close)
            watcher = Watcher({}, interval_s=1.0)
            from dsec.cluster.secret_file import SecretFile
            secret = SecretFile(self._secret_file)
            secret.current()         # there and valid, or the start fails saying so
            discovery = RayDiscovery(watcher, secret.current, ca_file=self._ca_file)
            await discovery.refresh()
            await watcher.start()
            stack.push_async_callback(watcher.stop)
            await discovery.start()
            stack.push_async_callback(discovery.stop)
            images = ImageService(Paths(Path(self._images_home)), keep_reader=True, settings=settings.images) \
                if self._images_home else None
            ctx = ApiContext(iam=iam, edges=discovery.edges, watcher=watcher, placer=Placer(k=2), images=images,
                             fncall=discovery.fncall, settings=settings)
            import ray
            sock = bind(self._host or ray.util.get_node_ip_address(), self._port, reuse_port=True)
            server = await serve(create_app(ctx), sock)
            stack.push_async_callback(stop, server)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        host, port = sock.getsockname()[:2]
        self._url = f"http://{host}:{port}"
        log.info("apiserver replica serving", extra={"replica": self.name, "url": self._url})

    async def address(self) -> dict[str, Any]:
        async with self._lock:
            if self._stack is None:
                await self._start()
        import ray
        return {"name": self.name, "url": self._url, "ray_node": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    async def stop(self) -> None:
        async with self._lock:
            stack, self._stack = self._stack, None
            if stack is not None:
                await stack.aclose()
