"""The embedded single-machine deployment: apiserver + one in-process edge + SQLite.

The composition root: the one place that names concrete backends (crun containers, QEMU VMs)
and wires the FnCall service beside the edge. Multi-node keeps the same pieces and swaps the
`edges` mapping for Ray actor handles (one edge per node) and the SQLite files for PostgreSQL;
nothing above the EdgeHandle boundary changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
from pathlib import Path
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

from dsec import log as dlog
from dsec import tracing
from dsec.agent.build import agent_binary
from dsec.apiserver.app import create_app
from dsec.apiserver.connections import server_protocol
from dsec.apiserver.context import ApiContext
from dsec.backends.base import Backend
from dsec.backends.container.driver import ContainerDriver
from dsec.config import DEFAULT_PORT, Paths
from dsec.edge.edge import Edge, EdgeSettings
from dsec.embedded.serverlock import hold_server_lock
from dsec.fncall.pool import FnCallSettings
from dsec.fncall.service import FnCallService
from dsec.iam import IAM
from dsec.images.service import ImageService
from dsec.placement import Placer
from dsec.security.netpolicy import RULESETS_FILE, Rulesets
from dsec.settings import Settings, VMSettings
from dsec.types import Conflict, DsecError
from dsec.watcher import Watcher

if TYPE_CHECKING:
    from dsec.backends.vm.driver import VMDriver
    from dsec.backends.vm.network import NodeNetwork

log = logging.getLogger("dsec.server")


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    node_id: str = "local"
    log_level: str = "INFO"


@asynccontextmanager
async def embedded(settings: Settings, node_id: str = "local"):
    """Everything one machine needs, started and torn down in order. `settings`: this process's,
    read once by the caller (Settings.from_env) and passed down from here."""
    paths = settings.paths
    paths.ensure()
    db = settings.cluster     # DSEC_DB_URL: PostgreSQL (D31)
    iam = IAM(db.db_url or paths.iam_db, home=paths.home, db=db)
    iam.bootstrap(paths.admin_key_file)
    async with node_services(settings, node_id, system_project(iam)) as (edge, fncall):
        watcher = Watcher({node_id: edge}, interval_s=1.0)
        await watcher.poll_once()
        await watcher.start()
        try:
            yield ApiContext(iam=iam, edges={node_id: edge}, watcher=watcher, placer=Placer(k=2),
                             images=edge.images, fncall={node_id: fncall}, settings=settings)
        finally:
            await watcher.stop()


@asynccontextmanager
async def node_services(settings: Settings, node_id: str, system_project_id: str
                        ) -> AsyncIterator[tuple[Edge, FnCallService]]:
    """One node's edge (its backends named here) and the FnCall service beside it: what the
    embedded server runs in-process and a cluster node serves over HTTP (dsec.cluster)."""
    async with node_edge(settings, node_id) as edge:
        # FnCall beside the edge: its warm pool containers are the system project's sandboxes
        fncall = FnCallService(edge, system_project_id, FnCallSettings.from_settings(settings.fncall))
        await fncall.start()
        try:
            yield edge, fncall
        finally:
            await fncall.close()    # its pool containers are a cache: stopped, not kept


@asynccontextmanager
async def node_edge(settings: Settings, node_id: str) -> AsyncIterator[Edge]:
    """The node's edge alone, started (adopting the sandboxes of its home) and closed after:
    node_services' core, and what clears a stale home (cluster/stale_homes.py) without a pool."""
    paths = settings.paths
    paths.ensure()
    images = ImageService(paths, keep_reader=True, settings=settings.images)
    rulesets = Rulesets(paths.home / RULESETS_FILE)   # operator's named network rule sets
    containers = ContainerDriver(paths, agent_binary(paths.bin), rulesets, conf=settings)
    backends: list[Backend] = [containers]
    # VMs with a NIC are plugged into the containers' node network (one bridge, forwarder, proxy)
    vm, vm_problem = await asyncio.to_thread(vm_driver, paths, settings.vm, containers.net, rulesets)
    if vm is not None:
        backends.append(vm)
    unavailable = {} if vm is not None else {kind: vm_problem for kind in VM_KINDS}
    edge = Edge(paths, images, backends, EdgeSettings(node_id=node_id, services=("fncall",)),
                unavailable=unavailable, conf=settings)
    await edge.start()
    try:
        yield edge
    finally:
        await edge.close()


def stop_node_lxcfs(home: Path) -> None:
    """Stop the home's lxcfs daemon (it outlives edges by design): only for a home whose
    sandboxes are all gone for good (cluster/stale_homes.py)."""
    from dsec.backends.container.lxcfs import Lxcfs
    Lxcfs(home / "lxcfs").stop()


VM_KINDS = ("microvm", "vm")
KEEP_ALIVE_S = 75


def vm_driver(paths: Paths, settings: VMSettings, net: "NodeNetwork | None" = None,
              rulesets: Rulesets | None = None) -> "tuple[VMDriver | None, tuple[str, str | None]]":
    """The QEMU backends when this node has QEMU and a fetched guest kernel; else why not and
    the fix (the node then offers containers and fncall only, and says so to placement)."""
    if not settings.enabled:
        return None, ("disabled by DSEC_VM=0", "start dsec without DSEC_VM=0")
    try:
        from dsec.backends.vm.driver import VMDriver
        from dsec.backends.vm.network import VMNetwork
        network = VMNetwork(net, rulesets) if net is not None and rulesets is not None else None
        return VMDriver(paths, settings, network), ("", None)
    except DsecError as e:
        log.warning("VM backends unavailable", extra={"reason": e.message})
        return None, (e.message, e.fix or "run `dsec vm fetch-kernel` and install qemu-system-x86 "
                                          "(scripts/install-extras.sh vm does both), then restart dsec")


def system_project(iam: IAM) -> str:
    """Id of the project `system` under the root: it owns platform sandboxes such as the FnCall
    backend's warm pool containers (visible to the root's keys, counted by admission)."""
    root = iam.root()
    for _ in range(2):
        for p in iam.children(root.id):
            if p.name == "system":
                return p.id
        try:
            return iam.create_project("system", root.id).id
        except Conflict:      # created concurrently
            continue
    raise Conflict("could not create the system project", field="system")


# What the server writes is for root alone: edge.db and a bundle's config.json hold sandboxes'
# env values, iam.db key hashes, the logs sandbox output, a VM's saved state its memory.
PRIVATE_UMASK = 0o077
_PRIVATE_GLOBS = ("*", "sb/*/config.json", "sb/*/run/*.log", "vm/sb/*/*", "vm/snapshots/*/*", "vm/consoles/*",
                  "vm/templates/*/*")


def make_private(paths: Paths) -> None:
    """From here on the server creates files 0600 and directories 0700 (those that others must
    traverse, e.g. a user-namespaced sandbox's bundle, are given their modes explicitly); the
    files an earlier version or another process left readable lose their group/other bits.
    The shared directories are made first, with the modes they always had."""
    paths.ensure()
    os.umask(PRIVATE_UMASK)
    for pattern in _PRIVATE_GLOBS:
        for f in paths.home.glob(pattern):
            try:
                st = f.lstat()
                if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                    os.chmod(f, stat.S_IMODE(st.st_mode) & 0o700)
            except OSError as e:        # gone meanwhile, or a filesystem that refuses
                log.warning("could not make a state file private", extra={"path": str(f), "error": str(e)})


def https_server(settings: Settings, host: str, app: Any) -> uvicorn.Server | None:
    """HTTPS for `{port}-{id}.{domain}` (and every other route) when a domain is set
    (DSEC_DOMAIN, DSEC_HTTPS_PORT; the certificate: apiserver/tls.py)."""
    srv = settings.server
    domain = srv.ingress_domain
    if not domain or not srv.https_port:
        return None
    from dsec.apiserver.e2b.hosts import check_domain
    from dsec.apiserver.tls import server_cert
    cert, key = server_cert(settings.paths.home, check_domain(domain), srv.tls_cert, srv.tls_key)
    config = uvicorn.Config(app, host=host, port=srv.https_port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=2, timeout_keep_alive=KEEP_ALIVE_S, http=server_protocol(),
                            ssl_certfile=str(cert), ssl_keyfile=str(key))
    log.info("dsec serving HTTPS", extra={"url": f"https://*.{domain}:{srv.https_port}", "certificate": str(cert)})
    return uvicorn.Server(config)


def serve(settings: Settings, opts: ServerOptions) -> None:
    """`dsec up`: `settings` are the server process's own (its environment, read once)."""
    dlog.configure(opts.log_level)
    paths = settings.paths
    make_private(paths)
    tracing.start(settings.observability, "dsec")   # OpenTelemetry when DSEC_OTLP_ENDPOINT/DSEC_TRACES_FILE

    async def main() -> None:
        async with embedded(settings, opts.node_id) as ctx:
            # keep-alive 75 s, far above httpx's 5 s pool expiry: a client never reuses a
            # connection the server is just closing (a lost stop under load, issue 22)
            app = create_app(ctx)
            config = uvicorn.Config(app, host=opts.host, port=opts.port, log_config=None,
                                    access_log=False, timeout_graceful_shutdown=2,
                                    timeout_keep_alive=KEEP_ALIVE_S, http=server_protocol())
            server = uvicorn.Server(config)
            https = https_server(settings, opts.host, app)
            log.info("dsec serving", extra={"url": f"http://{opts.host}:{opts.port}", "home": str(paths.home)})
            if https is None:
                await server.serve()
                return
            # the same app over TLS on a second port; whichever gets the signal, both stop
            tls_task = asyncio.create_task(https.serve())
            try:
                await server.serve()
            finally:
                https.should_exit = True
                await tls_task

    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal with the
    # handlers it found at start. With the defaults that kills the process before the edge has
    # closed (agents, pools, layer mounts); no-op handlers let the clean-up below finish.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    with hold_server_lock(paths):       # the one server of this home (serverlock.py)
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            pass
        finally:
            tracing.shutdown()      # the spans still batched for the collector
