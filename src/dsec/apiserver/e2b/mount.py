"""Assembles the E2B application (imports the e2b extra: connectrpc, protobuf-py, e2b stubs)."""

from __future__ import annotations

from dsec.apiserver.context import ApiContext
from dsec.apiserver.e2b.auth import AccessTokens, load_secret
from dsec.apiserver.e2b.dispatch import E2BDispatch
from dsec.apiserver.e2b.envd_files import files_app
from dsec.apiserver.e2b.envd_filesystem import filesystem_app
from dsec.apiserver.e2b.envd_process import process_app
from dsec.apiserver.e2b.rest import build_rest_app


def build(ctx: ApiContext, domain: str | None = None) -> E2BDispatch:
    """`domain`: what create answers name as the sandboxes' domain (DSEC_DOMAIN, or hosts.UNSET_DOMAIN), for get_host."""
    # the secret sits beside the IAM database: apiservers sharing one share the other
    tokens = AccessTokens(load_secret(ctx.iam.db_path.parent))
    process, filesystem = process_app(ctx), filesystem_app(ctx)
    return E2BDispatch(ctx, tokens, rest=build_rest_app(ctx, tokens, domain), envd_http=files_app(ctx),
                       rpc={process.path: process, filesystem.path: filesystem})
