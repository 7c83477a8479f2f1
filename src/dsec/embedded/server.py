"""The embedded single-machine deployment: apiserver + one in-process edge + SQLite.

Multi-node keeps the same pieces and swaps the `edges` mapping for Ray actor handles (one edge
per node) and the SQLite files for PostgreSQL; nothing above the EdgeHandle boundary changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn

from dsec import log as dlog
from dsec.agent.build import agent_binary
from dsec.apiserver.app import ApiContext, create_app
from dsec.backends.container.driver import ContainerDriver
from dsec.config import DEFAULT_PORT, Paths
from dsec.edge.edge import Edge, EdgeSettings
from dsec.iam import IAM
from dsec.images.service import ImageService
from dsec.placement import Placer
from dsec.types import Conflict, DsecError
from dsec.watcher import Watcher

if TYPE_CHECKING:
    from dsec.backends.vm.driver import VMDriver

log = logging.getLogger("dsec.server")


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    node_id: str = "local"
    log_level: str = "INFO"


@asynccontextmanager
async def embedded(paths: Paths, node_id: str = "local"):
    """Everything one machine needs, started and torn down in order."""
    paths.ensure()
    iam = IAM(paths.iam_db)
    iam.bootstrap(paths.admin_key_file)
    images = ImageService(paths)
    driver = ContainerDriver(paths, agent_binary(paths.bin))
    vm, vm_problem = await asyncio.to_thread(vm_driver, paths)
    edge = Edge(paths, images, driver, EdgeSettings(node_id=node_id, fncall_project=system_project(iam)),
                vm_driver=vm, vm_problem=vm_problem)
    await edge.start()
    watcher = Watcher({node_id: edge}, interval_s=1.0)
    await watcher.poll_once()
    await watcher.start()
    try:
        yield ApiContext(iam=iam, edges={node_id: edge}, watcher=watcher, placer=Placer(k=2), images=images)
    finally:
        await watcher.stop()
        await edge.close()


def vm_driver(paths: Paths) -> "tuple[VMDriver | None, str | None]":
    """The QEMU backends when this node has QEMU and a fetched guest kernel; else why not
    (the node then offers containers and fncall only, and says so to placement)."""
    if os.environ.get("DSEC_VM", "1") == "0":
        return None, "disabled by DSEC_VM=0"
    try:
        from dsec.backends.vm.driver import VMDriver
        return VMDriver(paths), None
    except DsecError as e:
        log.warning("VM backends unavailable", extra={"reason": e.message})
        return None, e.message


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


def serve(paths: Paths, opts: ServerOptions) -> None:
    dlog.configure(opts.log_level)

    async def main() -> None:
        async with embedded(paths, opts.node_id) as ctx:
            config = uvicorn.Config(create_app(ctx), host=opts.host, port=opts.port, log_config=None,
                                    access_log=False, timeout_graceful_shutdown=2)
            server = uvicorn.Server(config)
            paths.server_pid.write_text(str(os.getpid()))
            log.info("dsec serving", extra={"url": f"http://{opts.host}:{opts.port}", "home": str(paths.home)})
            try:
                await server.serve()
            finally:
                paths.server_pid.unlink(missing_ok=True)

    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal with the
    # handlers it found at start. With the defaults that kills the process before the edge has
    # closed (agents, pools, layer mounts); no-op handlers let the clean-up below finish.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
