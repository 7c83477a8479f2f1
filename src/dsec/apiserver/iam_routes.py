"""IAM over HTTP: nested projects, their quotas and their API keys.

A key acts for its project and every project below it: it lists, creates and removes
sub-projects there, mints and revokes their keys, and delegates part of its own quota (and
policy: PUT /v1/projects/{id}/policy in app.py) to them, never more than it holds. A project's
own quota and policy are set from above: a key cannot raise what its own project holds.
Projects and keys the caller may not reach answer 404, like missing ones.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import FastAPI, Query, Response

from dsec.apiserver.audit import note_target
from dsec.apiserver.deps import Who
from dsec.apiserver import quotas
from dsec.apiserver.context import ApiContext
from dsec.iam import ApiKeyInfo, Principal, Project
from dsec.iam.store import DEFAULT_ROTATION_GRACE_S, MAX_ROTATION_GRACE_S
from dsec.sdk.iam_types import (KeyInfo, KeyList, NewKey, ProjectCreate, ProjectInfo, ProjectList, QuotaInfo,
                                QuotaUpdate)
from dsec.types import Conflict, NotFound

PROJECT_FIX = "check the id and API key; list your projects with `dsec project ls`"


def _project(p: Project) -> ProjectInfo:
    return ProjectInfo.model_validate(p.model_dump())


def _key(k: ApiKeyInfo) -> KeyInfo:
    return KeyInfo.model_validate(k.model_dump())


def add_iam_routes(app: FastAPI, ctx: ApiContext) -> None:
    iam = ctx.iam

    def reachable(who: Principal, project_id: str) -> None:
        if not iam.can_access(who, project_id):
            raise NotFound(f"no project {project_id!r}", field="project_id", fix=PROJECT_FIX)

    @app.get("/v1/projects", response_model=ProjectList, tags=["iam"])
    async def list_projects(who: Who) -> ProjectList:
        """The caller's project and every project below it, top down."""
        return ProjectList(projects=[_project(p) for p in iam.subtree(who.project_id)])

    @app.post("/v1/projects", status_code=201, response_model=ProjectInfo, tags=["iam"])
    async def create_project(req: ProjectCreate, who: Who) -> ProjectInfo:
        """A sub-project of parent_id (default: the caller's project), with part of its quota."""
        parent = req.parent_id or who.project_id
        made = _project(iam.create_project(req.name, parent, max_sandboxes=req.max_sandboxes,
                                           max_cpu_cores=req.max_cpu_cores, max_memory_mb=req.max_memory_mb,
                                           by=who))
        note_target(made.id)
        return made

    @app.get("/v1/projects/{project_id}", response_model=ProjectInfo, tags=["iam"])
    async def get_project(project_id: str, who: Who) -> ProjectInfo:
        reachable(who, project_id)
        return _project(iam.project(project_id))

    @app.delete("/v1/projects/{project_id}", status_code=204, tags=["iam"])
    async def delete_project(project_id: str, who: Who) -> Response:
        """Remove an empty project (no sub-projects, no sandboxes) with its keys and policy."""
        reachable(who, project_id)
        for edge in ctx.edges.values():      # also sandboxes that hold no quota (platform pools)
            if await edge.list(project_id, False):
                raise Conflict(f"project {project_id} has sandboxes", field="project_id",
                               fix="stop its sandboxes first (`dsec sandbox ls`, `dsec sandbox rm`)")
        iam.delete_project(project_id, by=who)
        return Response(status_code=204)

    @app.get("/v1/projects/{project_id}/quota", response_model=QuotaInfo, tags=["iam"])
    async def get_quota(project_id: str, who: Who) -> QuotaInfo:
        """The project's limits and what it and its sub-projects hold now, on every node."""
        reachable(who, project_id)
        await quotas.reconcile(ctx)
        return QuotaInfo.model_validate(iam.quotas.quota(project_id).model_dump())

    @app.put("/v1/projects/{project_id}/quota", response_model=QuotaInfo, tags=["iam"])
    async def set_quota(project_id: str, req: QuotaUpdate, who: Who) -> QuotaInfo:
        """Change a sub-project's quota (from a key of a parent project), within the parent's."""
        reachable(who, project_id)
        iam.set_quota(project_id, max_sandboxes=req.max_sandboxes, max_cpu_cores=req.max_cpu_cores,
                      max_memory_mb=req.max_memory_mb, by=who)
        return QuotaInfo.model_validate(iam.quotas.quota(project_id).model_dump())

    @app.get("/v1/projects/{project_id}/keys", response_model=KeyList, tags=["iam"])
    async def list_keys(project_id: str, who: Who) -> KeyList:
        reachable(who, project_id)
        return KeyList(keys=[_key(k) for k in iam.list_keys(project_id)])

    @app.post("/v1/projects/{project_id}/keys", status_code=201, response_model=NewKey, tags=["iam"])
    async def create_key(project_id: str, who: Who,
                         role: Annotated[Literal["admin", "member"], Query(
                             description="admin: manages keys, reads the audit log; member: uses sandboxes")] = "admin"
                         ) -> NewKey:
        """A new API key of the project (from an admin key); the secret is in this answer only."""
        reachable(who, project_id)
        key = iam.create_key(project_id, role=role, by=who)
        info = iam.authenticate(key)
        note_target(info.key_id)
        return NewKey(**_key(iam.key_info(info.key_id)).model_dump(), key=key)

    @app.post("/v1/keys/{key_id}/rotate", status_code=201, response_model=NewKey, tags=["iam"])
    async def rotate_key(key_id: str, who: Who,
                         grace_s: Annotated[float, Query(ge=0, le=MAX_ROTATION_GRACE_S)] = DEFAULT_ROTATION_GRACE_S
                         ) -> NewKey:
        """Replace a key without downtime: a new key of the same project (its secret is in this
        answer only); the old one keeps working for grace_s seconds (0: ends now). `self` names
        the calling key."""
        old = who.key_id if key_id == "self" else key_id
        key, new_id = iam.rotate_key(old, grace_s=grace_s, by=who)
        return NewKey(**_key(iam.key_info(new_id)).model_dump(), key=key)

    @app.delete("/v1/keys/{key_id}", status_code=204, tags=["iam"])
    async def revoke_key(key_id: str, who: Who) -> Response:
        """Revoke a key of the caller's project or one below it (idempotent)."""
        iam.revoke_key(key_id, by=who)
        return Response(status_code=204)
