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
by it); an admin's (root project's) images are published to all. Letting RUN steps use the
network is an admin's choice (`network=true`), as is pulling from a registry (the node's
egress). Uploads are bounded by the guard (IMAGE_BODY_BYTES) and unpacked with tarfile's
"data" filter (no absolute paths, no links out, no devices or setuid bits).
"""

from __future__ import annotations

import asyncio
import logging
import tarfile
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse

from dsec.apiserver.guard import principal_of, request_key
from dsec.apiserver.tenancy import visible
from dsec.iam import Principal
from dsec.types import (NAME_RE, DsecError, ErrorDetail, Forbidden, ImageBuildResult, ImageConfig, ImageInfo,
                        ImageProgress, ImagePullRequest, InternalError, InvalidArgument, NotFound, Unavailable)

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext
    from dsec.images.progress import Progress
    from dsec.images.service import ImageService

log = logging.getLogger("dsec.apiserver.images")

Name = Annotated[str, Query(pattern=NAME_RE, description="the dsec image name to register")]


def _unpack(tar: Path, dest: Path, field: str) -> None:
    """Unpack an uploaded tar with the "data" filter: nothing lands outside `dest`."""
    try:
        with tarfile.open(tar, "r:*") as tf:
            tf.extractall(dest, filter="data")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise InvalidArgument(f"the request body is not a usable tar: {e}", field=field,
                              fix="send a tar (optionally gzip/xz/bzip2-compressed) of the directory") from None


def _ndjson(images: "ImageService", work: Path,
            fn: "Callable[[Progress], ImageBuildResult]") -> StreamingResponse:
    """Run fn on the node's heavy lane; stream its progress, then its result or error. The work
    dir (the upload) is removed when fn is done, whether or not the client still listens."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ImageProgress | None] = asyncio.Queue()

    def progress(message: str, fraction: float | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ImageProgress(message=message[-500:], fraction=fraction))

    async def runner() -> None:
        try:
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
            queue.put_nowait(None)

    task = asyncio.create_task(runner())

    async def lines() -> AsyncIterator[str]:
        while (item := await queue.get()) is not None:
            yield item.model_dump_json() + "\n"
        await task

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def add_image_routes(app: FastAPI, ctx: "ApiContext") -> None:
    def principal(request: Request) -> Principal:
        return principal_of(request) or ctx.iam.authenticate(request_key(request))

    def services() -> "ImageService":
        if ctx.images is None:
            raise Unavailable("this apiserver has no image registry attached")
        return ctx.images

    def owner_of(who: Principal) -> str | None:
        return None if who.project_id == ctx.iam.root().id else who.project_id

    def admin_only(who: Principal, what: str, field: str) -> None:
        if owner_of(who) is not None:
            raise Forbidden(f"only an admin (a key of the root project) may {what}", field=field,
                            fix="leave it off, or ask an admin")

    async def upload(request: Request, images: "ImageService") -> Path:
        base = images.paths.home / "build"
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="upload-", dir=base))
        try:
            with open(work / "body.tar", "wb") as f:
                async for chunk in request.stream():     # bounded by the guard (IMAGE_BODY_BYTES)
                    f.write(chunk)
        except BaseException:
            from dsec.images.builder import safe_rmtree
            await asyncio.to_thread(safe_rmtree, work)
            raise
        if (work / "body.tar").stat().st_size == 0:
            from dsec.images.builder import safe_rmtree
            await asyncio.to_thread(safe_rmtree, work)
            raise InvalidArgument("the request body is empty", field="body", fix="send the tar as the body")
        return work

    @app.post("/v1/images/build", response_class=StreamingResponse,
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "ImageProgress lines, the last with result or error"}})
    async def build_image(request: Request, name: Name,
                          dockerfile: Annotated[str, Query(max_length=255)] = "Dockerfile",
                          replace: bool = False, network: bool = False,
                          memory_mb: Annotated[int, Query(ge=64, le=65536)] = 2048,
                          timeout_s: Annotated[float, Query(gt=0, le=7200)] = 1800) -> StreamingResponse:
        """Build the Dockerfile in the uploaded context (a tar) with buildah; RUN steps run
        unprivileged in a user namespace without network (network=true: admin only)."""
        who = principal(request)
        images = services()
        if network:
            admin_only(who, "let RUN steps use the network", "network")
        work = await upload(request, images)
        owner = owner_of(who)

        def build(progress: "Progress") -> ImageBuildResult:
            from dsec.images.dockerfile import build_dockerfile
            context = work / "context"
            context.mkdir()
            _unpack(work / "body.tar", context, "body")
            (work / "body.tar").unlink()
            return build_dockerfile(images, name, context, dockerfile=dockerfile, replace=replace,
                                    network=network, memory_mb=memory_mb, timeout_s=timeout_s,
                                    progress=progress, owner=owner,
                                    usable=lambda info: visible(ctx.iam, who, info))
        return _ndjson(images, work, build)

    @app.post("/v1/images/import", response_class=StreamingResponse,
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "ImageProgress lines, the last with result or error"}})
    async def import_image(request: Request, name: Name,
                           format: Literal["oci", "docker-archive"] = "oci",
                           ref: Annotated[str | None, Query(max_length=255)] = None,
                           replace: bool = False) -> StreamingResponse:
        """Import an uploaded OCI layout (as a tar) or `docker save` archive."""
        who = principal(request)
        images = services()
        owner = owner_of(who)
        _check_replace(images, name, replace, owner)
        work = await upload(request, images)

        def run(progress: "Progress") -> ImageBuildResult:
            if format == "oci":
                layout = work / "layout"
                layout.mkdir()
                _unpack(work / "body.tar", layout, "body")
                info = images.import_oci(name, oci=layout, ref=ref, replace=replace, progress=progress,
                                         source=f"upload:oci:{name}")
            else:
                info = images.import_oci(name, docker_archive=work / "body.tar", replace=replace,
                                         progress=progress, source=f"upload:docker-archive:{name}")
            return ImageBuildResult(image=_own(images, info, owner))
        return _ndjson(images, work, run)

    @app.post("/v1/images/pull", response_class=StreamingResponse,
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "ImageProgress lines, the last with result or error"}})
    async def pull_image(request: Request, req: ImagePullRequest) -> StreamingResponse:
        """Admin only: pull from a registry the node reaches (skopeo), then import."""
        who = principal(request)
        images = services()
        admin_only(who, "pull images from registries (the node's egress)", "ref")
        base = images.paths.home / "build"
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="pull-", dir=base))

        def run(progress: "Progress") -> ImageBuildResult:
            return ImageBuildResult(image=images.pull(req.name, req.ref, tls_verify=req.tls_verify,
                                                      creds=req.creds, replace=req.replace, progress=progress))
        return _ndjson(images, work, run)

    @app.get("/v1/images/{name}/config", response_model=ImageConfig)
    async def get_image_config(request: Request, name: str) -> ImageConfig:
        """The ENV/WORKDIR/USER/CMD a Dockerfile gave the image (empty for other images)."""
        who = principal(request)
        images = services()
        info = images.get(name)
        if not visible(ctx.iam, who, info):
            raise NotFound(f"no image {name!r} for this project", field="image",
                           fix="list the images you may use with GET /v1/images")
        from dsec.images.dockerfile import image_config
        return await asyncio.to_thread(image_config, images, name)


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

