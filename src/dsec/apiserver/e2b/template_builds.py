"""E2B template builds in flight on this apiserver: their uploads, status and logs.

A build is requested (POST /v3/templates), gets its COPY tars uploaded (PUT .../files/{hash}),
is started (POST /v2/templates/{id}/builds/{buildID}) and polled (GET .../status). Its uploads
live in a work dir under DSEC_HOME/build (as native builds' contexts do) and are counted against
the project's uploads in flight (images/uploads.py) until the build ends or is abandoned. The
build itself is a native Dockerfile build (images/dockerfile.py): the same jail, no network,
the project owns the image.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.types import CapacityExceeded, DsecError, InvalidArgument, NotFound

if TYPE_CHECKING:
    from dsec.images.service import ImageService
    from dsec.images.uploads import UploadHold

log = logging.getLogger("dsec.apiserver.e2b")

MAX_PENDING = 8            # builds a project may have requested and not finished, per apiserver
ABANDON_S = 3600           # a requested build never started (or a finished one) is forgotten after this
MAX_LOG_ENTRIES = 2000     # the newest are kept
PAGE = 100                 # E2B's status endpoint answers at most 100 log entries per call


@dataclass(eq=False)
class Build:
    project: str
    name: str                   # the template's name: the dsec image it builds
    build_id: str
    work: Path
    hold: UploadHold
    status: str = "waiting"     # E2B's: waiting (requested), building, ready, error
    uploaded: set[str] = field(default_factory=set)
    logs: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0            # log entries dropped from the front (offsets stay E2B's)
    reason: dict[str, Any] | None = None
    touched: float = field(default_factory=time.monotonic)

    def log(self, message: str, level: str = "info") -> None:
        self.logs.append({"timestamp": datetime.now(UTC).isoformat(), "level": level,
                          "message": message[-2000:]})
        if len(self.logs) > MAX_LOG_ENTRIES:
            cut = len(self.logs) - MAX_LOG_ENTRIES
            del self.logs[:cut]
            self.dropped += cut

    def page(self, offset: int, limit: int) -> list[dict[str, Any]]:
        start = max(0, offset - self.dropped)
        return self.logs[start:start + min(limit, PAGE)]

    @property
    def files(self) -> Path:
        return self.work / "uploads"


@dataclass(eq=False)
class TemplateBuilds:
    images: ImageService
    builds: dict[str, Build] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def request(self, project: str, name: str, max_disk_mb: int | None) -> Build:
        self._sweep()
        pending = [b for b in self.builds.values() if b.project == project and b.status in ("waiting", "building")]
        if len(pending) >= MAX_PENDING:
            raise CapacityExceeded(f"this project has {len(pending)} template builds requested or running on "
                                   "this server", field="name",
                                   fix=f"wait for them to finish (or {ABANDON_S // 60} minutes for unstarted "
                                       "ones to be dropped)")
        base = self.images.paths.home / "build"
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="e2b-template-", dir=base))
        (work / "uploads").mkdir()
        b = Build(project=project, name=name, build_id=secrets.token_hex(16), work=work,
                  hold=self.images.uploads.hold(project, max_disk_mb))
        self.builds[b.build_id] = b
        return b

    def get(self, project: str, template_id: str, build_id: str) -> Build:
        """The caller's build (another project's looks missing)."""
        b = self.builds.get(build_id)
        if b is None or b.project != project or b.name != template_id:
            raise NotFound(f"no build {build_id[:40]!r} of template {template_id[:80]!r} for this project",
                           field="buildID", fix="request the build again (Template.build)")
        b.touched = time.monotonic()
        return b

    def latest(self, project: str, template_id: str) -> Build:
        """The caller's newest build of a template that is still waiting for its files."""
        for b in reversed(list(self.builds.values())):
            if b.project == project and b.name == template_id and b.status == "waiting":
                b.touched = time.monotonic()
                return b
        raise NotFound(f"no requested build of template {template_id[:80]!r} for this project",
                       field="templateID", fix="request the build first (Template.build does)")

    async def receive(self, b: Build, digest: str, chunks: Any) -> None:
        """Store an uploaded tar (body chunks), counted against the project's uploads."""
        dest = b.files / f"{digest}.tar"
        part = dest.with_suffix(".part")
        try:
            with open(part, "wb") as f:      # noqa: ASYNC230 (local disk, as image_routes.upload)
                async for chunk in chunks:
                    b.hold.add(len(chunk), "the template file upload")
                    f.write(chunk)
            if part.stat().st_size == 0:
                raise InvalidArgument("the upload is empty", field="body", fix="send the tar the SDK made")
            part.replace(dest)
        finally:
            part.unlink(missing_ok=True)
        b.uploaded.add(digest)

    def start(self, b: Build, run: Any) -> None:
        """Run `run(build)` (a coroutine function) in the background; the build ends with it."""
        b.status = "building"
        task = asyncio.create_task(self._run(b, run))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, b: Build, run: Any) -> None:
        try:
            await run(b)
            b.status = "ready"
            b.log(f"template {b.name} is ready")
        except DsecError as e:
            self._fail(b, f"{e.message}" + (f" (fix: {e.fix})" if e.fix else ""))
        except Exception as e:         # a bug: say so in the status, keep the traceback in the log
            log.exception("template build failed")
            self._fail(b, f"internal error ({type(e).__name__}); see the server log")
        finally:
            self._release(b)

    def refuse(self, b: Build, message: str) -> None:
        """End a build whose start was refused: failed, its files and upload hold released."""
        self._fail(b, message)
        self._release(b)

    def _fail(self, b: Build, message: str) -> None:
        b.log(message, "error")
        b.status = "error"
        b.reason = {"message": message, "step": "finalize", "logEntries": b.logs[-20:]}

    def _release(self, b: Build) -> None:
        from dsec.images.builder import safe_rmtree
        safe_rmtree(b.work)
        b.hold.release()
        b.touched = time.monotonic()

    def _sweep(self) -> None:
        """Forget finished builds and drop unstarted ones after ABANDON_S."""
        now = time.monotonic()
        for b in list(self.builds.values()):
            if b.status != "building" and now - b.touched > ABANDON_S:
                if b.status == "waiting":
                    self._release(b)
                del self.builds[b.build_id]

    def close(self) -> None:
        for b in self.builds.values():
            if b.status == "waiting":
                self._release(b)

