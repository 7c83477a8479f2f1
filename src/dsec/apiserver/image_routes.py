"""HTTP routes that make images, each answering NDJSON progress lines (ImageProgress) and a
last line with `result` (ImageBuildResult) or `error` (ErrorDetail):

    POST /v1/images/build?name=N[&dockerfile=Dockerfile&replace=&network=]
         body: the build context as a tar (gzip/zstd/xz too), Dockerfile inside; buildah builds
         it (images/dockerfile.py), FROM naming dsec images the caller may use
    POST /v1/images/import?name=N&format=oci|docker-archive[&ref=&replace=]
         body: an OCI image layout as a tar, or a `docker save` tar
    POST /v1/images/pull   ImagePullRequest (JSON; skopeo from a registry the node reaches)
    GET  /v1/images/{name}/config   ImageConfig of an image built from a Dockerfile

Tenancy: what a project makes is owned by it (visible to it and its relatives, replaced only
by it); an admin's (root project's) images are published to all. Builds through the API have
no network (`network=true` is refused: buildah runs in a network namespace of its own, D45);
pulling from a registry (the node's egress) is an admin's choice. Uploads are bounded by the guard (DSEC_IMAGE_UPLOAD_MAX_BYTES) and unpacked by bsdtar chrooted
into the upload dir (images/unpack.py: no path resolves outside it; no owners, devices or
setuid bits); what a project's uploads in flight hold on the node's disk is counted against its
max_disk_mb (images/uploads.py).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import replace
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse

from dsec.apiserver.deps import admin_only, caller, is_admin
from dsec.apiserver.tenancy import visible
from dsec.iam import Principal
from dsec.types import (NAME_RE, DsecError, ErrorDetail, ImageBuildResult, ImageConfig, ImageInfo,
                        ImageProgress, ImagePullRequest, InternalError, InvalidArgument, NotFound, Unavailable)

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext
    from dsec.images.progress import Progress
    from dsec.images.service import ImageService
    from dsec.images.uploads import UploadHold

log = logging.getLogger("dsec.apiserver.images")

Name = Annotated[str, Query(pattern=NAME_RE, description="the dsec image name to register")]


def _unpack(tar: Path, dest: Path, field: str, hold: "UploadHold", body_bytes: int) -> None:
    """Unpack an uploaded tar beneath `dest` (images/unpack.py: chrooted bsdtar; no owners,
    special bits, devices or xattrs; '..' refused), bounded in what it unpacks to (never more
    than the body limit nor the project's disk policy), that bound counted against the
    project's uploads in flight first."""
    from dsec.images.unpack import UPLOAD_RULES, bounded, unpack_beneath
    rules = bounded(UPLOAD_RULES, tar, body_bytes)
    # what the unpack may write: its own bound, or what the project's room still allows
    rules = replace(rules, max_bytes=hold.add_up_to(rules.max_bytes or body_bytes, "unpacking the request body"))
    unpack_beneath(tar, dest, field=field, what="the request body", rules=rules)


def _ndjson(images: "ImageService", work: Path, project: str,
            fn: "Callable[[Progress], ImageBuildResult]", hold: "UploadHold | None" = None) -> StreamingResponse:
    """Run fn on the node's heavy lane; stream its progress, then its result or error. The work
    dir (the upload) is removed when fn is done, whether or not the client still listens, and
    what the upload held is given back."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ImageProgress | None] = asyncio.Queue()

    def progress(message: str, fraction: float | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ImageProgress(message=message[-500:], fraction=fraction))

    async def runner() -> None:
        try:
            async with images.heavy.slot(project):    # shared fairly with other projects
                result = await images.heavy.run(fn, progress)
            queue.put_nowait(ImageProgress(message="done", fraction=1.0, result=result))
        except DsecError as e:
            queue.put_nowait(ImageProgress(error=ErrorDetail(**e.to_body()["error"])))
        except Exception as e:      # a bug: say so on the stream, keep the traceback in the log
            log.exception("image work failed")
            err = InternalError(f"image work failed: {type(e).__name__}: {e}")
            queue.put_nowait(ImageProgress(error=ErrorDetail(**err.to_body()["error"])))
        finally:
            from dsec.images.builder import safe_rmtree
            await asyncio.to_thread(safe_rmtree, work)
            if hold is not None:
                hold.release()
            queue.put_nowait(None)

    task = asyncio.create_task(runner())

    async def lines() -> AsyncIterator[str]:
        while (item := await queue.get()) is not None:
            yield item.model_dump_json() + "\n"
        await task

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def add_image_routes(app: FastAPI, ctx: "ApiContext") -> None:
    def services() -> "ImageService":
        if ctx.images is None:
            raise Unavailable("this apiserver has no image registry attached")
        return ctx.images

    def owner_of(who: Principal) -> str | None:
        return None if is_admin(ctx, who) else who.project_id

    async def upload(request: Request, images: "ImageService", who: Principal) -> tuple[Path, "UploadHold"]:
        """The body, streamed to a work dir under DSEC_HOME/build; its bytes (and later what it
        unpacks to) counted against the project's uploads in flight (images/uploads.py)."""
        hold = images.uploads.hold(who.project_id, ctx.iam.effective_policy(who.project_id).max_disk_mb)
        base = images.paths.home / "build"
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="upload-", dir=base))
        try:
            with open(work / "body.tar", "wb") as f:
                async for chunk in request.stream():     # bounded by the guard (DSEC_IMAGE_UPLOAD_MAX_BYTES)
                    hold.add(len(chunk))
                    f.write(chunk)
            if (work / "body.tar").stat().st_size == 0:
                raise InvalidArgument("the request body is empty", field="body", fix="send the tar as the body")
        except BaseException:
            from dsec.images.builder import safe_rmtree
            await asyncio.to_thread(safe_rmtree, work)
            hold.release()
            raise
        return work, hold

    @app.post("/v1/images/build", response_class=StreamingResponse,
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "ImageProgress lines, the last with result or error"}})
    async def build_image(request: Request, name: Name,
                          dockerfile: Annotated[str, Query(max_length=255)] = "Dockerfile",
                          replace: bool = False, network: bool = False,
                          memory_mb: Annotated[int | None, Query(ge=64, le=65536)] = None,
                          timeout_s: Annotated[float, Query(gt=0, le=7200)] = 1800) -> StreamingResponse:
        """Build the Dockerfile in the uploaded context (a tar) with buildah; RUN steps run
        unprivileged in a user namespace without network (network=true is refused)."""
        who = caller(request)
        images = services()
        if network:
            # buildah runs in a network namespace of its own (images/build_jail.py): a build
            # reaches nothing until its steps egress through the sandboxes' policy path
            raise InvalidArgument("builds through the API have no network: RUN steps and ADD reach "
                                  "nothing (a build must not use the node's own network)", field="network",
                                  fix="leave network off and put what the build needs into the context; "
                                      "an operator on the node may build with `dsec image build --network`")
        memory_mb = build_memory(ctx, who, memory_mb)
        work, hold = await upload(request, images, who)
        owner = owner_of(who)

        def build(progress: "Progress") -> ImageBuildResult:
            from dsec.images.dockerfile import build_dockerfile
            context = work / "context"
            context.mkdir()
            _unpack(work / "body.tar", context, "body", hold, ctx.settings.server.image_upload_max_bytes)
            (work / "body.tar").unlink()
            return build_dockerfile(images, name, context, dockerfile=dockerfile, replace=replace,
                                    network=network, memory_mb=memory_mb, timeout_s=timeout_s,
                                    progress=progress, owner=owner,
                                    usable=lambda info: visible(ctx.iam, who, info))
        return _ndjson(images, work, who.project_id, build, hold)

    @app.post("/v1/images/import", response_class=StreamingResponse,
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "ImageProgress lines, the last with result or error"}})
    async def import_image(request: Request, name: Name,
                           format: Literal["oci", "docker-archive"] = "oci",
                           ref: Annotated[str | None, Query(max_length=255)] = None,
                           replace: bool = False) -> StreamingResponse:
        """Import an uploaded OCI layout (as a tar) or `docker save` archive."""
        who = caller(request)
        images = services()
        owner = owner_of(who)
        _check_replace(images, name, replace, owner)
        work, hold = await upload(request, images, who)

        def run(progress: "Progress") -> ImageBuildResult:
            if format == "oci":
                layout = work / "layout"
                layout.mkdir()
                _unpack(work / "body.tar", layout, "body", hold,
                        ctx.settings.server.image_upload_max_bytes)
                info = images.import_oci(name, oci=layout, ref=ref, replace=replace, progress=progress,
                                         source=f"upload:oci:{name}")
            else:
                info = images.import_oci(name, docker_archive=work / "body.tar", replace=replace,
                                         progress=progress, source=f"upload:docker-archive:{name}")
            return ImageBuildResult(image=_own(images, info, owner))
        return _ndjson(images, work, who.project_id, run, hold)

    @app.post("/v1/images/pull", response_class=StreamingResponse,
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "ImageProgress lines, the last with result or error"}})
    async def pull_image(request: Request, req: ImagePullRequest) -> StreamingResponse:
        """Admin only: pull from a registry the node reaches (skopeo), then import."""
        who = caller(request)
        images = services()
        admin_only(ctx, who, "pull images from registries (the node's egress)", "ref")
        base = images.paths.home / "build"
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="pull-", dir=base))

        def run(progress: "Progress") -> ImageBuildResult:
            return ImageBuildResult(image=images.pull(req.name, req.ref, tls_verify=req.tls_verify,
                                                      creds=req.creds, replace=req.replace, progress=progress))
        return _ndjson(images, work, who.project_id, run)

    @app.get("/v1/images/{name}/config", response_model=ImageConfig)
    async def get_image_config(request: Request, name: str) -> ImageConfig:
        """The ENV/WORKDIR/USER/CMD a Dockerfile gave the image (empty for other images)."""
        who = caller(request)
        images = services()
        info = images.get(name)
        if not visible(ctx.iam, who, info):
            raise NotFound(f"no image {name!r} for this project", field="image",
                           fix="list the images you may use with GET /v1/images")
        from dsec.images.dockerfile import image_config
        return await asyncio.to_thread(image_config, images, name)


BUILD_MEMORY_MB = 2048      # a build's RUN steps, unless the caller or its project says less


def build_memory(ctx: "ApiContext", who: Principal, asked: int | None) -> int:
    """The memory limit of a build's RUN steps: what was asked (default BUILD_MEMORY_MB), never
    above the project's policy (max_memory_mb) or its quota; asking for more is refused."""
    caps = [("the project's policy (max_memory_mb)", ctx.iam.effective_policy(who.project_id).max_memory_mb),
            ("the project's memory quota", ctx.iam.project(who.project_id).max_memory_mb)]
    bound = min((c for _, c in caps if c is not None), default=None)
    if asked is None:
        return min(BUILD_MEMORY_MB, bound) if bound is not None else BUILD_MEMORY_MB
    for what, cap in caps:
        if cap is not None and asked > cap:
            raise InvalidArgument(f"memory_mb {asked} is above {what}: {cap}", field="memory_mb",
                                  fix=f"ask for at most {cap} MiB, or leave memory_mb off")
    return asked


def _check_replace(images: "ImageService", name: str, replace: bool, owner: str | None) -> None:
    from dsec.images.store import check_may_replace
    from dsec.types import Conflict
    existing = images.registry.get_image(name)
    if existing is not None:
        if not replace:
            raise Conflict(f"image {name!r} already exists", field="name", fix="pass replace=true")
        check_may_replace(existing, owner)


def _own(images: "ImageService", info: ImageInfo, owner: str | None) -> ImageInfo:
    return images.registry.set_owner(info.name, owner) if owner is not None else info

