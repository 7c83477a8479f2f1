"""E2B's template build API (the SDK's Template / AsyncTemplate) on dsec's Dockerfile builds.

    POST /v3/templates                                {name|alias, tags, cpuCount, memoryMB} -> 202
    GET  /templates/{templateID}/files/{hash}         {present, url, headers}: where to PUT a COPY tar
    PUT  /templates/{templateID}/files/{hash}         the tar (the url above; X-API-KEY as any call)
    POST /v2/templates/{templateID}/builds/{buildID}  the steps (template_steps.py) -> 202, built async
    GET  /templates/{templateID}/builds/{buildID}/status?logsOffset=&limit=
    GET  /templates/aliases/{alias}                   Template.exists: 200 yours or published, else 404

A template is a dsec image of the caller's project, named by the template's name: it is built
like POST /v1/images/build (images/dockerfile.py, the same jail, no network), another project
cannot see or use it, and Sandbox.create(name) starts it with its ENV and WORKDIR (rest.py).
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from dsec.apiserver.context import ApiContext
from dsec.apiserver.deps import is_admin
from dsec.apiserver.e2b.errors import Unsupported
from dsec.apiserver.e2b.template_builds import Build, TemplateBuilds
from dsec.apiserver.e2b.template_steps import (
    BASE_ALIASES,
    FILES_DIR,
    HASH_RE,
    Plan,
    base_of,
    plan,
)
from dsec.apiserver.guard import E2B_KEY_HEADER, principal_of, request_key
from dsec.apiserver.tenancy import unusable, visible
from dsec.iam import Principal
from dsec.types import (
    NAME_RE,
    DsecError,
    ImageInfo,
    InvalidArgument,
    NotFound,
    Unauthorized,
    Unavailable,
)

_NAME = re.compile(NAME_RE)


def _who(request: Request) -> Principal:
    p = principal_of(request)
    if p is None:
        raise Unauthorized("no API key", field="X-API-KEY", fix="set E2B_API_KEY to a dsec API key")
    return p


def _hash(value: str) -> str:
    if not HASH_RE.match(value):
        raise InvalidArgument(f"hash {value[:80]!r} is not a sha256 hex digest", field="hash",
                              fix="send the filesHash the SDK computed")
    return value


def add_template_routes(app: FastAPI, ctx: ApiContext) -> TemplateBuilds | None:
    if ctx.images is None:
        return None      # an apiserver without an image registry: the routes stay 501 (rest.py)
    images = ctx.images
    builds = TemplateBuilds(images)

    def _lookup(name: str) -> ImageInfo | None:
        """This node's image, or the shared layer store's (images.get)."""
        try:
            return images.get(name)
        except NotFound:
            return None

    def owner_of(who: Principal) -> str | None:
        return None if is_admin(ctx, who) else who.project_id

    @app.post("/v3/templates", status_code=202)
    async def request_build(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        who = _who(request)
        name = str(body.get("name") or body.get("alias") or "")
        _refuse_extras(body)
        if not _NAME.match(name) or name in BASE_ALIASES:
            raise InvalidArgument(f"name {name[:80]!r} is not a template name dsec can use", field="name",
                                  fix="use letters, digits and . _ - (up to 128), not an E2B default like 'base'")
        existing = images.registry.get_image(name)
        if existing is not None:
            from dsec.images.store import check_may_replace
            check_may_replace(existing, owner_of(who))     # another project's name: 403
        b = builds.request(who.project_id, name, ctx.iam.effective_policy(who.project_id).max_disk_mb)
        return {"templateID": name, "buildID": b.build_id, "public": False, "names": [name], "tags": [],
                "aliases": [name]}

    @app.get("/templates/{template_id}/files/{digest}", status_code=201)
    async def upload_link(request: Request, template_id: str, digest: str) -> dict[str, Any]:
        who = _who(request)
        b = builds.latest(who.project_id, template_id)
        digest = _hash(digest)
        # the upload is one more call of the caller's: the SDK sends these headers with it
        url = str(request.url.replace(query=""))      # the upload is a PUT to this very path
        return {"present": digest in b.uploaded, "url": url,
                "headers": {E2B_KEY_HEADER: request_key(request) or ""}}

    @app.put("/templates/{template_id}/files/{digest}", status_code=201)
    async def upload(request: Request, template_id: str, digest: str) -> Response:
        who = _who(request)
        b = builds.latest(who.project_id, template_id)
        try:
            await builds.receive(b, _hash(digest), request.stream())
        except DsecError as e:          # refused (size, empty, bad hash): the build ends, its dir goes
            builds.refuse(b, e.message)
            raise
        return Response(status_code=201)

    @app.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
    async def start(request: Request, template_id: str, build_id: str,
                    body: Annotated[dict[str, Any], Body()]) -> Response:
        who = _who(request)
        b = builds.get(who.project_id, template_id, build_id)
        if b.status != "waiting":
            raise InvalidArgument(f"build {build_id} was started already", field="buildID",
                                  fix="request a new build (Template.build does)")
        try:
            where = "fromImage" if body.get("fromImage") else "fromTemplate"
            p = plan(body, await _base_user(who, base_of(body), where))
            missing = [h for h in p.hashes if h not in b.uploaded]
            if missing:
                raise InvalidArgument(f"the files of COPY step(s) with filesHash {missing[0][:12]}... were not "
                                      "uploaded", field="steps.filesHash", fix="upload them first (Template.build does)")
            from dsec.apiserver.image_routes import build_memory
            memory_mb = build_memory(ctx, who, None)
        except DsecError as e:          # refused: the build ends here, its work dir and upload hold go
            builds.refuse(b, e.message)
            raise
        b.log(f"building {b.name} from {p.base} ({len(p.dockerfile.splitlines())} Dockerfile lines)")
        builds.start(b, lambda build: _run(ctx, who, owner_of(who), build, p, memory_mb))
        return Response(status_code=202)

    @app.get("/templates/{template_id}/builds/{build_id}/status")
    async def status(request: Request, template_id: str, build_id: str, logsOffset: int = 0,
                     limit: int = 100) -> dict[str, Any]:
        who = _who(request)
        b = builds.get(who.project_id, template_id, build_id)
        out: dict[str, Any] = {"templateID": b.name, "buildID": b.build_id, "status": b.status, "logs": [],
                               "logEntries": b.page(max(0, logsOffset), max(0, limit))}
        if b.reason is not None:
            out["reason"] = b.reason
        return out

    @app.get("/templates/aliases/{alias}")
    async def alias(request: Request, alias: str) -> JSONResponse:
        who = _who(request)
        name = BASE_ALIASES.get(alias, alias)
        info = await asyncio.to_thread(_lookup, name) if _NAME.match(name) else None
        if info is None or info.kind != "image" or not visible(ctx.iam, who, info):
            # another project's template looks missing, as its images do (tenancy.py)
            raise NotFound(f"no template {alias[:80]!r} for this project", field="alias",
                           fix="build it with Template.build, or list images with GET /v1/images")
        return JSONResponse({"templateID": name, "public": info.owner is None})

    async def _base_user(who: Principal, name: str, where: str) -> str | None:
        """The base's USER (None: root); the base must be an image the caller may use (another
        project's looks missing, as at sandbox creation)."""
        info = await asyncio.to_thread(_lookup, name)
        if info is None or info.kind != "image" or not visible(ctx.iam, who, info):
            raise unusable(where, name)
        from dsec.images.dockerfile import image_config
        return (await asyncio.to_thread(image_config, images, name)).user or None

    app.state.e2b_template_builds = builds
    return builds


def _refuse_extras(body: dict[str, Any]) -> None:
    """What a dsec image cannot carry: the sandbox's size is chosen at create, not by the template."""
    if body.get("tags"):
        raise Unsupported("tags: dsec templates have no tags", field="tags",
                          fix="build each tag as a name of its own, e.g. 'my-t-v2'")
    for key, fix in (("cpuCount", "metadata={'dsec.cpu_cores': ...}"), ("memoryMB", "metadata={'dsec.memory_mb': ...}"),
                     ("minFreeDiskMb", "the project's disk policy")):
        if body.get(key) is not None:
            raise Unsupported(f"{key}: a dsec template does not carry sandbox resources", field=key,
                              fix=f"leave it off and size the sandbox at create ({fix})")
    if body.get("teamID"):
        raise Unsupported("teamID: a template belongs to the project of the API key", field="teamID",
                          fix="leave it off; use a key of the project that should own it")


async def _run(ctx: ApiContext, who: Principal, owner: str | None, b: Build, p: Plan, memory_mb: int) -> None:
    """Unpack the uploads into a context, write the Dockerfile, build it on the heavy lane."""
    images = ctx.images
    if images is None:
        raise Unavailable("this apiserver has no image registry attached")
    loop = asyncio.get_running_loop()

    def progress(message: str, fraction: float | None) -> None:
        loop.call_soon_threadsafe(b.log, message)

    def work(progress: Any) -> None:
        from dsec.apiserver.image_routes import _unpack
        from dsec.images.dockerfile import build_dockerfile
        context = b.work / "context"
        (context / FILES_DIR).mkdir(parents=True)
        for digest in p.hashes:
            dest = context / FILES_DIR / digest
            dest.mkdir()
            tar = b.files / f"{digest}.tar"
            _unpack(tar, dest, "body", b.hold, ctx.settings.server.image_upload_max_bytes)
        for rel, text in p.scripts.items():
            (context / rel).parent.mkdir(parents=True, exist_ok=True)
            (context / rel).write_text(text)
        (context / "Dockerfile").write_text(p.dockerfile)
        build_dockerfile(images, b.name, context, replace=True, memory_mb=memory_mb, progress=progress,
                         owner=owner, usable=lambda info: visible(ctx.iam, who, info))

    async with images.heavy.slot(who.project_id):
        await images.heavy.run(work, progress)
