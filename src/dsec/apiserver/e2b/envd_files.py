"""envd's HTTP API: GET /health, GET /files (download), POST /files (multipart or
octet-stream upload). Errors are E2B-shaped; the SDK maps 404 to FileNotFoundException."""

from __future__ import annotations

import gzip
import posixpath
import zlib

from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsec.apiserver.context import ApiContext
from dsec.apiserver.control import check_file_user_in
from dsec.apiserver.e2b.envd_common import Target, abs_path, account, user_name
from dsec.apiserver.e2b.errors import Unsupported, e2b_response
from dsec.apiserver.guard import MAX_FILE_BYTES
from dsec.types import DsecError, Forbidden, InvalidArgument, PayloadTooLarge

METADATA_PREFIX = "x-metadata-"
TARGET_KEY = "e2b_target"      # scope["state"] key the dispatcher puts the Target under


def target(request: Request) -> Target:
    t = request.scope.get("state", {}).get(TARGET_KEY)
    assert isinstance(t, Target), "envd routes are reached through the E2B dispatcher only"
    return t


async def _user(request: Request, t: Target) -> str | None:
    """The user a file request acts as (?username=; E2B's "user" is the sandbox's own)."""
    return await account(t, user_name(request.query_params.get("username")))


def _user_path(request: Request, path: str | None, user: str | None) -> str:
    """The absolute path (a relative one is relative to the user's home, as envd has it)."""
    if not path:
        raise InvalidArgument("path is missing", field="path", fix="pass the file path")
    return abs_path(path, user=user)


async def _checked_user(request: Request, t: Target) -> str | None:
    """The request's user, once the project's policy allows it (root: allow_root)."""
    user = await _user(request, t)
    check_file_user_in(request.app.state.ctx, t.info.project, user)
    return user


def denied(e: DsecError, user: str | None, path: str) -> DsecError:
    """EACCES from the agent as envd answers it: permission denied for that user (403)."""
    if isinstance(e, InvalidArgument) and e.message.endswith("(Permission denied)"):
        who = user or "user"
        return Forbidden(f"permission denied: user '{who}' may not access {path}: {e.message}", field="path",
                         fix="act as a user allowed to (user='root' where the project allows root), or change "
                             "the file's permissions")
    return e


async def health(request: Request) -> Response:
    return Response(status_code=204)


async def download(request: Request) -> Response:
    t = target(request)
    user = await _checked_user(request, t)
    path = _user_path(request, request.query_params.get("path"), user)
    try:
        data = await t.edge.read_file(t.sandbox_id, path, MAX_FILE_BYTES, user=user)
    except DsecError as e:
        raise denied(e, user, path) from None
    name = posixpath.basename(path)
    return Response(data, media_type="application/octet-stream",
                    headers={"content-disposition": f'inline; filename="{name}"'})


def _check_no_metadata(request: Request) -> None:
    keys = [k for k in request.headers if k.lower().startswith(METADATA_PREFIX)]
    if keys:
        raise Unsupported(f"file metadata ({keys[0]}) is not stored by dsec", field="metadata",
                          fix="write files without metadata")


async def _body(request: Request) -> bytes:
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "gzip":
        try:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            body = d.decompress(body, MAX_FILE_BYTES + 1)
        except (zlib.error, gzip.BadGzipFile) as e:
            raise InvalidArgument(f"the gzip body could not be decompressed: {e}", field="body",
                                  fix="send a gzip body, or leave out Content-Encoding") from None
        if len(body) > MAX_FILE_BYTES:
            raise PayloadTooLarge(f"file larger than {MAX_FILE_BYTES} bytes", field="body",
                                  fix="split the file into parts of at most 64 MiB")
    elif encoding != "identity":
        raise InvalidArgument(f"Content-Encoding {encoding!r} is not supported", field="content-encoding",
                              fix="send gzip or identity")
    return body


async def upload(request: Request) -> Response:
    t = target(request)
    _check_no_metadata(request)
    user = await _checked_user(request, t)
    ctype = request.headers.get("content-type", "")
    written: list[tuple[str, bytes]] = []
    if ctype.startswith("multipart/form-data"):
        form = await request.form(max_files=1000, max_fields=1000)
        files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
        for value in files:
            # multi-file uploads name each file by its path; a single one may use ?path=
            raw = request.query_params.get("path") if len(files) == 1 else None
            written.append((_user_path(request, raw or value.filename, user), await value.read()))
    else:
        written.append((_user_path(request, request.query_params.get("path"), user), await _body(request)))
    if not written:
        raise InvalidArgument("no file in the upload", field="file", fix="send the file as multipart field 'file'")
    for path, data in written:
        try:
            await t.edge.write_file(t.sandbox_id, path, data, 0o644, True, user=user)
        except DsecError as e:
            raise denied(e, user, path) from None
    return JSONResponse([{"name": posixpath.basename(p), "type": "file", "path": p} for p, _ in written])


async def _dsec_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, DsecError)
    return e2b_response(e)


def files_app(ctx: ApiContext) -> Starlette:
    """The envd HTTP routes (the dispatcher resolved and authenticated the sandbox)."""
    app = Starlette(routes=[Route("/health", health, methods=["GET"]),
                            Route("/files", download, methods=["GET"]),
                            Route("/files", upload, methods=["POST"])],
                    exception_handlers={DsecError: _dsec_error})
    app.state.ctx = ctx      # the project's policy bounds root file calls
    return app
