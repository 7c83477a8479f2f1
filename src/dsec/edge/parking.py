"""Parking: suspend/resume (one and in bulk) and VM snapshots.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from datetime import datetime, timezone
from typing import Any

from dsec.agent.client import AgentError
from dsec.backends.base import Hibernation, Parking, SnapshotLayers, Snapshots
from dsec.edge.live import LiveSandbox
from dsec.types import (EventType, BulkItem, DsecError, NotFound, SandboxInfo, SandboxState, SnapshotImage, SnapshotInfo,
                        Unavailable,
                        make_snapshot_id)
from dsec.edge.core import BULK_PARALLEL, EdgeCore, log

_HOLDING = (SandboxState.creating, SandboxState.running, SandboxState.suspended)


class ParkingVerbs(EdgeCore):
    async def snapshot(self, sandbox_id: str, measure: bool = True, name: str | None = None) -> SnapshotInfo:
        """Save a running sandbox so it can be restored as new sandboxes (`snapshot=` in its args).
        measure=False (a fork's own snapshot): size_bytes is what the backend counted while
        taking it, without a walk of the files (0 for a container: shared with its source).
        `name` ('name:tag', checked by the caller) is kept with it (E2B's snapshot names)."""
        live = self._running(sandbox_id)
        snaps = self._capability(live.rec, Snapshots, "snapshot")
        rec = live.rec
        self._touch(rec)
        snap_id = make_snapshot_id(self.node_id)
        created = time.time()
        rec.in_flight += 1
        try:
            # args: what a sandbox made from it runs with by default (containers: env, workdir, limits ...)
            size = await snaps.snapshot(rec.id, snap_id, {"image": rec.image, "image_digest": rec.image_digest,
                                                          "project": rec.project, "created_at": created,
                                                          "name": name, "args": rec.args.model_dump(mode="json")})
        finally:
            rec.in_flight -= 1
        log.info("snapshot", extra={"sandbox": rec.id, "snapshot": snap_id, "bytes": size})
        if not measure:
            return self._snapshot_info({"id": snap_id, "backend": rec.backend, "image": rec.image,
                                        "project": rec.project, "sandbox_id": rec.id, "created_at": created,
                                        "size_bytes": size, "name": name})
        return await self.get_snapshot(snap_id)

    def _snapshot_backends(self) -> builtins.list[Snapshots]:
        return [b for b in self._distinct_backends() if isinstance(b, Snapshots)]

    def _snapshot_info(self, r: dict[str, Any]) -> SnapshotInfo:
        return SnapshotInfo(node=self.node_id, **{**r, "created_at": datetime.fromtimestamp(r["created_at"], timezone.utc)})

    def _find_snapshot(self, snapshot_id: str) -> tuple[Snapshots, dict[str, Any]]:
        """The backend holding the snapshot, and its record (file reads: call in a thread)."""
        for b in self._snapshot_backends():
            try:
                return b, b.snapshot_record(snapshot_id)
            except NotFound:
                continue
        raise NotFound(f"no snapshot {snapshot_id!r} on node {self.node_id}", field="snapshot_id",
                       fix="use an id returned by Sandbox.snapshot(); list them with `dsec vm snapshot ls`")

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        _, record = await asyncio.to_thread(self._find_snapshot, snapshot_id)
        return self._snapshot_info(record)

    async def list_snapshots(self, project: str | None = None) -> builtins.list[SnapshotInfo]:
        out: builtins.list[SnapshotInfo] = []
        for b in self._snapshot_backends():
            out += [self._snapshot_info(r) for r in await asyncio.to_thread(b.snapshot_records)
                    if project is None or r["project"] == project]
        return out

    async def export_snapshot(self, snapshot_id: str) -> SnapshotImage:
        """A container snapshot as a workspace layer in the shared layer store (packed once,
        named after the snapshot), for a create on another node when this one takes no new
        sandboxes (draining, full). VM snapshots are refused, naming why."""
        owner, record = await asyncio.to_thread(self._find_snapshot, snapshot_id)
        if not isinstance(owner, SnapshotLayers):
            raise Unavailable(f"snapshot {snapshot_id} is a {record['backend']} snapshot: it holds the guest's memory "
                              f"and devices, which restore only on the node that took it ({self.node_id})",
                              field="snapshot", fix=f"restore it when node {self.node_id} takes sandboxes again "
                                                    f"(`dsec nodes uncordon {self.node_id}`), or snapshot a sandbox "
                                                    "running on another node")
        if self.images.shared is None:
            raise Unavailable(f"snapshot {snapshot_id} lives on node {self.node_id}, and no shared layer store "
                              "is configured to carry it to another node", field="DSEC_LAYER_STORE",
                              fix="set DSEC_LAYER_STORE on every node (`cluster up --edge-env DSEC_LAYER_STORE=...`), "
                                  f"or restore it when node {self.node_id} takes sandboxes again")
        name = f"{snapshot_id}@export"
        async with self._export_lock:     # one pack per snapshot, however many creates ask at once
            view, meta = await asyncio.to_thread(owner.snapshot_layers, snapshot_id)
            args = dict(meta.get("args") or {})
            if self.images.registry.get_image(name) is None:
                workspace = args.get("workspace")
                parents = [await self.stacks.resolve(workspace, "workspace")] if workspace else []
                project = meta.get("project", "")
                async with self.images.heavy.slot(project):
                    await self.images.heavy.run(self.images.pack_upper, name, view.path, parents=parents, scrub=[],
                                                source=f"snapshot:{snapshot_id}", map_id=view.map_id,
                                                below=view.below, owner=project)
                log.info("snapshot exported", extra={"snapshot": snapshot_id, "layer": name})
        return SnapshotImage(snapshot=snapshot_id, image=str(args.get("image") or meta.get("image", "")),
                             workspace=name, args=args)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot. Sandboxes restored from it keep running and restoring: they hold
        their own links to what they need of it."""
        owner, _ = await asyncio.to_thread(self._find_snapshot, snapshot_id)
        await owner.delete_snapshot(snapshot_id)
        log.info("snapshot deleted", extra={"snapshot": snapshot_id})

    async def drop_export(self, snapshot_id: str, unpublish: bool = False) -> builtins.list[str] | None:
        """After its snapshot's delete: this node's sandboxes (created, running, parked) and
        snapshots made from the export `<snapshot id>@export`. None of them: the export leaves
        this node's registry (layer files in use by a mount stay readable until it goes), and
        with `unpublish` the shared layer store (asked of the snapshot's node once no node uses
        it). None: this node knows no such export."""
        name = f"{snapshot_id}@export"
        known = await asyncio.to_thread(self.images.registry.get_image, name) is not None
        if not known and not unpublish:
            return None       # never fetched here: nothing of this node can use it (no scan)
        users = []
        if known:      # the live table in the loop's thread; snapshot records in a thread (file reads)
            users = sorted([live.id for live in self._live.values() if live.rec.state in _HOLDING
                            and getattr(live.rec.args, "workspace", None) == name]
                           + await asyncio.to_thread(self._export_snapshots, name))
        if not users:
            if known:
                try:
                    await asyncio.to_thread(self.images.remove, name)
                except NotFound:
                    pass
                self.stacks.forget(name)
            if unpublish and self.images.shared is not None:
                known = bool(await asyncio.to_thread(self.images.shared.unpublish, name)) or known
            if known:
                log.info("snapshot export dropped", extra={"snapshot": snapshot_id, "unpublished": unpublish})
        return users if users or known else None

    def _export_snapshots(self, name: str) -> builtins.list[str]:
        """This node's snapshots whose workspace is the export (file reads: call in a thread)."""
        out = []
        for b in self._snapshot_backends():
            if isinstance(b, SnapshotLayers):
                for r in b.snapshot_records():
                    try:
                        if (b.snapshot_layers(r["id"])[1].get("args") or {}).get("workspace") == name:
                            out.append(r["id"])
                    except NotFound:
                        continue
        return out

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        """Park a sandbox: off the CPU, its memory freed, its state kept. Its next request (or
        resume()) brings it back where it was, running commands included."""
        live = self._running(sandbox_id)
        parking = self._capability(live.rec, Parking, "suspend")
        async with live.park_lock:
            if live.rec.state != SandboxState.running:
                return live.rec.info(self.node_id)
            live.backend.unwatch_exit(live.id)    # parking stops its runtime on purpose
            # tracked execs read the connection dropped below: let go of the running ones (the
            # agent keeps their output; exec_follow/attach re-attach there after the resume)
            for exec_id, t in list(live.commands.tracked.items()):
                if not t.done and t.task is not None:
                    del live.commands.tracked[exec_id]
                    t.error = Unavailable(f"sandbox {live.id} was suspended while exec {exec_id} was followed; "
                                          "it runs on", field="exec_id", fix="follow or attach it again")
                    t.task.cancel()
            to_disk = live.backend if isinstance(live.backend, Hibernation) and await self._quiescent_agent(live) else None
            await live.drop_agent()
            try:
                size = await to_disk.hibernate(live.id) if to_disk is not None else None
                # where its memory went, for the metrics (a container frozen in place keeps it in RAM/swap)
                live.parked_where = "disk" if size is not None or not isinstance(live.backend, Hibernation) else "memory"
                if size is None:
                    size = await parking.park(live.id)
            except BaseException:
                self._watch_exit(live)        # it runs on (a park that failed undoes itself)
                raise
            live.rec.state = SandboxState.suspended
            self._load.update(live.rec, live=True)
            self.records.set_state(live.id, SandboxState.suspended)
            self._emit(EventType.paused, live.rec, where=live.parked_where)
        log.info("sandbox parked", extra={"sandbox": live.id, "bytes": size})
        return live.rec.info(self.node_id)

    async def _quiescent_agent(self, live: LiveSandbox) -> bool:
        """Whether the sandbox may be parked to disk as far as the edge can tell: no request is
        using it, and its agent keeps no exec (running, or finished with output nobody
        collected: a fresh agent would not have it). The backend (Hibernation) then checks
        that nothing but the agent runs in it."""
        if live.execs or live.rec.in_flight:
            return False
        try:
            return not await (await live.connect()).list_execs()
        except (DsecError, OSError, AgentError):
            return False

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Bring a parked sandbox back (no-op for a running one)."""
        rec = self._record(sandbox_id)
        live = self._live.get(sandbox_id)
        if live is None:
            return rec.info(self.node_id)
        async with live.park_lock:
            if rec.state == SandboxState.suspended:
                parking = self._capability(rec, Parking, "resume")
                self.admission.admit(await self._node_status(), rec.cpu_cores, rec.memory_mb)
                t0 = time.monotonic()
                try:
                    await parking.unpark(rec.id)
                    await self._adopt_agent(live)
                except DsecError as e:
                    await self._fail(live, f"could not resume the parked sandbox: {e.message}")
                    raise
                rec.state = SandboxState.running
                self._load.update(rec, live=True)
                self.records.set_state(rec.id, SandboxState.running)
                self._restart_lifetime(rec)
                self._emit(EventType.resumed, rec)
                self._watch_exit(live)
                self._schedule(rec)
                log.info("sandbox resumed", extra={"sandbox": rec.id, "seconds": round(time.monotonic() - t0, 3)})
        self._touch(rec)
        return rec.info(self.node_id)

    def _restart_lifetime(self, rec: Any) -> None:
        """A sandbox that its timeout paused (on_timeout='pause', Reaping._pause_at_timeout:
        no lifetime left) runs lifetime_s again from its resume, as E2B's auto-resume does."""
        lifetime = getattr(rec.args, "lifetime_s", None)
        if rec.expires_at is None and lifetime and getattr(rec.args, "on_timeout", "stop") == "pause":
            rec.expires_at = time.time() + lifetime
            self.records.set_expires_at(rec.id, rec.expires_at)

    async def suspend_many(self, sandbox_ids: builtins.list[str]) -> builtins.list[BulkItem]:
        """Park many at once (trainer preemption), BULK_PARALLEL at a time; each one's outcome."""
        return await self._bulk(sandbox_ids, self.suspend)

    async def resume_many(self, sandbox_ids: builtins.list[str]) -> builtins.list[BulkItem]:
        return await self._bulk(sandbox_ids, self.resume)

    async def _bulk(self, sandbox_ids: builtins.list[str], verb: Any) -> builtins.list[BulkItem]:
        slots = asyncio.Semaphore(BULK_PARALLEL)

        async def one(sid: str) -> BulkItem:
            async with slots:
                try:
                    info = await verb(sid)
                    return BulkItem(id=sid, state=info.state)
                except DsecError as e:
                    live = self._live.get(sid)
                    return BulkItem(id=sid, state=live.rec.state if live is not None else None, error=e.message)
        return builtins.list(await asyncio.gather(*(one(s) for s in sandbox_ids)))
