"""Harbor environments on dsec sandboxes: `pip install 'dsec-sandbox[harbor]'` (Python >= 3.12, as Harbor).

Harbor loads a custom environment by import path; point it here (docs/adapters.md):

    harbor trial start -p TASK -a oracle -e dsec.adapters.harbor:DsecEnvironment \\
        --environment-kwarg url=http://dsec:7620 --environment-kwarg api_key=$KEY

or in a TrialConfig / JobConfig: `environment: {import_path: "dsec.adapters.harbor:DsecEnvironment",
kwargs: {url: ..., api_key: ...}}`. The task's `[environment] docker_image` names a dsec image
(`dsec image ls`); without one, `environment/Dockerfile` is built on the dsec server
(POST /v1/images/build: buildah, FROM naming dsec images) once per content hash, and its ENV
and WORKDIR apply to every command. Commands run as root by default (Harbor's container default).

Like every adapter this module imports only dsec's client SDK and types: it runs wherever
Harbor runs and talks to any dsec over HTTP.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import tarfile
import tempfile
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import require_agent_environment_definition
from harbor.models.task.config import NetworkMode
from harbor.models.trial.paths import EnvironmentPaths

from dsec.sdk.client import Client, Sandbox
from dsec.types import ContainerArgs, DsecError, ImageConfig, NetworkPolicy, NotFound

DEFAULT_TIMEOUT_S = 24 * 3600.0          # Harbor's "no timeout": dsec's longest exec
PART_BYTES = 32 << 20                    # files API: at most 64 MiB per write
_NAME_BAD = re.compile(r"[^A-Za-z0-9._+-]+")


def image_name_for(environment_name: str, content_hash: str) -> str:
    """The dsec image a task's Dockerfile builds into: one per environment content hash."""
    base = _NAME_BAD.sub("-", environment_name).strip("-.")[:80] or "env"
    return f"harbor-{base}-{content_hash[:12]}"


class DsecEnvironment(BaseEnvironment):
    """A Harbor environment backed by one dsec container sandbox.

    kwargs (Harbor's `--environment-kwarg key=value` / `environment.kwargs`): url, api_key (default
    $DSEC_URL / $DSEC_API_KEY, else the local dsec), image (overrides the task's docker_image),
    ttl_idle_s, build_network (let the Dockerfile's RUN steps use the network: admin keys only),
    container_kwargs (more ContainerArgs fields, e.g. {"disk_mb": 20480})."""

    def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                 task_env_config: Any, logger: Any = None, *, url: str | None = None, api_key: str | None = None,
                 image: str | None = None, ttl_idle_s: int = 3600, build_network: bool = False,
                 container_kwargs: dict[str, Any] | None = None, **kwargs: Any):
        self._url, self._api_key = url, api_key
        self._image_override = image
        self._ttl_idle_s = int(ttl_idle_s)
        self._build_network = _truthy(build_network)
        self._container_kwargs = dict(container_kwargs or {})
        self._client: Client | None = None
        self._sandbox: Sandbox | None = None
        self._config = ImageConfig()
        self._uids: dict[str, str] = {}
        super().__init__(environment_dir=environment_dir, environment_name=environment_name,
                         session_id=session_id, trial_paths=trial_paths, task_env_config=task_env_config,
                         logger=logger, **kwargs)

    # ---- what Harbor asks of an environment type ----------------------------------------

    @staticmethod
    def type() -> str:
        return "dsec"

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # cpus and memory_mb are hard ceilings (cgroup quota and limit)
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # sandboxes start with no egress (dsec's default), or with all of it for "public"
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        if self._image_override:
            return
        require_agent_environment_definition(self.environment_dir,
                                             docker_image=self.task_env_config.docker_image)

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        self._client = Client(self._url, self._api_key)
        image = await self._image(force_build)
        cfg = self.task_env_config
        args: dict[str, Any] = {
            "image": image, "user": "root", "ttl_idle_s": self._ttl_idle_s,
            "env": {**self._config.env, **self._startup_env()},
            "workdir": cfg.workdir or self._config.workdir or "/",
            "labels": {"harbor-session": self.session_id[:63]},
            "network": self._network(),
        }
        if self._effective_cpus:
            args["cpu_cores"] = float(self._effective_cpus)
        if self._effective_memory_mb:
            args["memory_mb"] = int(self._effective_memory_mb)
        if self._effective_storage_mb:
            args["disk_mb"] = max(64, int(self._effective_storage_mb))
        args.update(self._container_kwargs)
        self.logger.debug(f"creating dsec sandbox from {image}")
        self._sandbox = await self._client.create_container(ContainerArgs(**args))
        # New top-level directories are made through the files API: in VM sandboxes a command
        # may not create one under / (docs/adapters.md; containers may, D11). Harbor's /logs/..., /tests, /solution, the workdir.
        paths = EnvironmentPaths()
        await self._make_dirs([*self._mount_targets(writable_only=True), str(paths.agent_dir),
                               str(paths.verifier_dir), str(paths.artifacts_dir), str(paths.tests_dir),
                               str(paths.solution_dir), *([cfg.workdir] if cfg.workdir else [])])
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Stops the sandbox (dsec sandboxes are not kept: `delete` makes no difference)."""
        sb, client = self._sandbox, self._client
        self._sandbox = self._client = None
        try:
            if sb is not None:
                try:
                    await sb.stop()
                except NotFound:
                    pass
        finally:
            if client is not None:
                await client.close()

    async def _image(self, force_build: bool) -> str:
        assert self._client is not None
        given = self._image_override or self.task_env_config.docker_image
        if given:
            self._config = await self._client.image_config(given)
            return given
        name = image_name_for(self.environment_name, self.environment_id)
        have = {i.name for i in await self._client.images()}
        if force_build or name not in have:
            self.logger.info(f"building {name} from {self.environment_dir / 'Dockerfile'} on dsec")
            res = await self._client.build_image(
                name, self.environment_dir, replace=True, network=self._build_network,
                timeout_s=float(self.task_env_config.build_timeout_sec),
                on_progress=lambda ev: self.logger.debug(ev.message))
            self._config = res.config
        else:
            self._config = await self._client.image_config(name)
        return name

    def _network(self) -> NetworkPolicy:
        if self.network_policy.network_mode == NetworkMode.PUBLIC:
            return NetworkPolicy.model_validate({"rules": [{"cidr": "0.0.0.0/0"}, {"cidr": "::/0"}]})
        return NetworkPolicy()

    # ---- commands -----------------------------------------------------------------------

    def _sb(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the dsec sandbox is not started: call start() first")
        return self._sandbox

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        sb = self._sb()
        who = await self._user(self._resolve_user(user))
        merged = self._merge_env(env) or {}
        wd = cwd or self.task_env_config.workdir or self._config.workdir
        r = await sb.run(command, cwd=wd, env=merged, user=who,
                         timeout_s=float(timeout_sec) if timeout_sec else DEFAULT_TIMEOUT_S)
        if r.timed_out:     # as Harbor's docker environment says it
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        code = r.exit_code if r.exit_code is not None else 128 + (r.signal or 9)
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=code)

    async def _user(self, user: str | int | None) -> str:
        """Harbor's user (None, root, a name or a uid) as dsec's 'root' / 'UID[:GID]'."""
        if user is None or str(user) in ("root", "0"):
            return "root"
        if isinstance(user, int) or str(user).isdigit():
            return str(user)
        name = str(user)
        if name not in self._uids:
            r = await self._sb().run(f"id -u {shlex.quote(name)}; id -g {shlex.quote(name)}", user="root")
            ids = r.stdout.split()
            if r.exit_code != 0 or len(ids) != 2:
                raise ValueError(f"user {name!r} does not exist in the sandbox's image")
            self._uids[name] = f"{ids[0]}:{ids[1]}" if ids[0] != "0" else "root"
        return self._uids[name]

    # ---- files --------------------------------------------------------------------------

    async def _make_dirs(self, dirs: list[str]) -> None:
        """Create each directory's top-level ancestor through the files API (then `mkdir -p`
        from a command works below it)."""
        sb = self._sb()
        tops = sorted({PurePosixPath(d).parts[1] for d in dirs if d and PurePosixPath(d).is_absolute()
                       and len(PurePosixPath(d).parts) > 1})
        listing = {e.name for e in await sb.files.list("/")}
        for top in tops:
            if top not in listing:
                keep = f"/{top}/.dsec-keep-{uuid.uuid4().hex[:8]}"
                await sb.files.write(keep, b"", mkdirs=True)
                await sb.files.remove(keep)

    async def _write(self, target: str, data: bytes) -> None:
        sb = self._sb()
        await self._make_dirs([target])
        if len(data) <= PART_BYTES:
            await sb.files.write(target, data, mkdirs=True)
            return
        parts = []
        for i in range(0, len(data), PART_BYTES):
            part = f"{target}.dsec-part{i // PART_BYTES:05d}"
            await sb.files.write(part, data[i:i + PART_BYTES], mkdirs=True)
            parts.append(part)
        q = " ".join(shlex.quote(p) for p in parts)
        r = await sb.run(f"cat {q} > {shlex.quote(target)}; rc=$?; rm -f {q}; exit $rc", user="root")
        if r.exit_code != 0:
            raise RuntimeError(f"joining the parts of {target} failed: {r.stderr}")

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._write(target_path, Path(source_path).read_bytes())

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        src = Path(source_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"{src} is not a directory")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            for entry in sorted(os.listdir(src)):
                tf.add(src / entry, arcname=entry)
        await self._make_dirs([target_dir])
        tmp = f"/tmp/.hb-up-{uuid.uuid4().hex}.tar.gz"
        await self._write(tmp, buf.getvalue())
        r = await self._sb().run(f"mkdir -p {shlex.quote(target_dir)} && tar -xzf {tmp} -C {shlex.quote(target_dir)}"
                                 f"; rc=$?; rm -f {tmp}; exit $rc", user="root")
        if r.exit_code != 0:
            raise RuntimeError(f"unpacking into {target_dir} failed (exit {r.exit_code}): {r.stderr[-2000:]}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        try:
            data = await self._sb().files.read(source_path)
        except NotFound:
            raise FileNotFoundError(f"{source_path} does not exist in the sandbox") from None
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        sb = self._sb()
        tmp = f"/tmp/.hb-down-{uuid.uuid4().hex}.tar"
        r = await sb.run(f"tar -cf {tmp} -C {shlex.quote(source_dir)} .", user="root")
        try:
            if r.exit_code != 0:
                raise RuntimeError(f"packing {source_dir} failed (exit {r.exit_code}): {r.stderr[-2000:]}")
            data = await sb.files.read(tmp)
        finally:
            await sb.run(f"rm -f {tmp}", user="root")
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as f:
            f.write(data)
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as tf:
                tf.extractall(target, filter=transfer_tar_filter)


def _truthy(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")


__all__ = ["DsecEnvironment", "image_name_for", "DsecError"]
