"""E2B template steps -> a Dockerfile that dsec builds (images/dockerfile.py, in its build jail).

The SDK's builder (Template().from_image(...).run_cmd(...).copy(...)...) reaches the server as
TemplateBuildStartV2: a base (fromImage / fromTemplate), steps of type RUN, COPY, ENV, WORKDIR,
USER, and an optional startCmd / readyCmd. Each COPY names the hash of a tar the SDK uploaded;
it is unpacked under `files/<hash>/` of the build context and copied from there. Every value is
written into the Dockerfile in a form it cannot break out of (JSON exec/array forms, quoted
ENV values); what cannot be written safely is refused naming the step.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from dsec.apiserver.e2b.errors import Unsupported
from dsec.apiserver.e2b.mapping import TEMPLATE_ALIASES
from dsec.types import ENV_KEY_RE, InvalidArgument

HASH_RE = re.compile(r"^[0-9a-f]{64}$")
FILES_DIR = "files"                       # under the context: files/<hash>/<the SDK's tar>
SERVICE_DIR = "/etc/dsec-template"        # start.sh / ready.sh of a template (control.py runs them)
# E2B's default base images (the SDK's from_base_image, Sandbox's default template): dsec's own
# E2B's default templates as the create path names them (mapping.TEMPLATE_ALIASES), plus the names
# the SDK's from_base_image() sends
BASE_ALIASES = {**TEMPLATE_ALIASES, "e2bdev/base": TEMPLATE_ALIASES["base"],
                "e2bdev/base:latest": TEMPLATE_ALIASES["base"]}
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?$")
_MODE_RE = re.compile(r"^[0-7]{3,4}$")


@dataclass
class Plan:
    """What one build needs: the base image, the Dockerfile, the COPY tars it reads, and the
    start/ready scripts to put into the image."""

    base: str
    dockerfile: str
    hashes: list[str] = field(default_factory=list)
    scripts: dict[str, str] = field(default_factory=dict)      # context path -> content


def _bad(where: str, why: str, fix: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {why}", field=where, fix=fix)


def _line_safe(value: str, where: str) -> str:
    if "\n" in value or "\r" in value or "\x00" in value:
        raise _bad(where, "a line break or NUL cannot be written into this instruction",
                   "put it on one line")
    return value


def _quote_env(value: str) -> str:
    """A Dockerfile ENV value in double quotes: \\, " and $ escaped (no variable expansion)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def base_of(body: dict[str, Any]) -> str:
    """The dsec image the template builds on (fromImage or fromTemplate), by name."""
    if body.get("fromImageRegistry"):
        raise Unsupported("fromImageRegistry: dsec builds pull nothing from registries with credentials",
                          field="fromImageRegistry",
                          fix="have an admin pull the image into dsec (POST /v1/images/pull) and use "
                              "from_image('<its dsec name>')")
    image, template = body.get("fromImage"), body.get("fromTemplate")
    if bool(image) == bool(template):
        raise InvalidArgument("give exactly one of fromImage and fromTemplate", field="fromImage",
                              fix="start the template with from_image('debian-python') or from_template('base')")
    name = str(image or template)
    where = "fromImage" if image else "fromTemplate"
    name = BASE_ALIASES.get(name, name)
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}$", name):
        raise InvalidArgument(f"{where} {name[:80]!r} is not a dsec image name", field=where,
                              fix="name a dsec image (debian-python, busybox, code-interpreter, one of your "
                                  "templates); a registry image must be pulled into dsec first")
    return name


def plan(body: dict[str, Any], base_user: str | None = None) -> Plan:
    """The Dockerfile of a TemplateBuildStartV2 body. `base_user`: the base image's USER (RUN
    steps with a user of their own switch back to the user in effect)."""
    base = base_of(body)
    lines = [f"FROM {base}"]
    out = Plan(base=base, dockerfile="")
    user = base_user or "root"
    steps = body.get("steps") or []
    if not isinstance(steps, list):
        raise InvalidArgument("steps must be a list", field="steps", fix="send the SDK's steps as they are")
    for i, step in enumerate(steps):
        lines += _step(i, step, user, out)
        if isinstance(step, dict) and step.get("type") == "USER":
            user = str(step["args"][0])
    _services(body, out, lines)
    out.dockerfile = "\n".join(lines) + "\n"
    return out


def _args(i: int, step: dict[str, Any], least: int) -> list[str]:
    args = step.get("args") or []
    if not isinstance(args, list) or len(args) < least or not all(isinstance(a, str) for a in args):
        raise InvalidArgument(f"steps[{i}].args: {step.get('type')} needs at least {least} string argument(s)",
                              field=f"steps[{i}].args", fix="send the SDK's steps as they are")
    return args


def _user(value: str, where: str) -> str:
    if not _USER_RE.match(value):
        raise _bad(where, f"{value[:40]!r} is not a user name or user:group", "use e.g. 'user' or 'root'")
    return value


def _step(i: int, step: Any, user: str, out: Plan) -> list[str]:
    if not isinstance(step, dict):
        raise InvalidArgument(f"steps[{i}] is not an object", field=f"steps[{i}]", fix="send the SDK's steps")
    kind = step.get("type")
    if kind == "RUN":
        args = _args(i, step, 1)
        run = f"RUN {json.dumps(['/bin/sh', '-c', args[0]])}"
        as_user = args[1] if len(args) > 1 and args[1] else None
        if as_user is None or as_user == user:
            return [run]
        return [f"USER {_user(as_user, f'steps[{i}].args')}", run, f"USER {user}"]
    if kind == "COPY":
        return [_copy(i, step, out)]
    if kind == "ENV":
        args = _args(i, step, 2)
        if len(args) % 2:
            raise _bad(f"steps[{i}].args", "ENV needs key, value pairs", "send the SDK's steps as they are")
        pairs = []
        for k, v in zip(args[0::2], args[1::2]):
            if not ENV_KEY_RE.match(k):
                raise _bad(f"steps[{i}].args", f"{k[:40]!r} is not an environment variable name",
                           "use letters, digits and _ (not starting with a digit)")
            pairs.append(f"{k}={_quote_env(_line_safe(v, f'steps[{i}].args'))}")
        return ["ENV " + " ".join(pairs)]
    if kind == "WORKDIR":
        path = _line_safe(_args(i, step, 1)[0], f"steps[{i}].args")
        if not path.strip() or path.strip() != path:
            raise _bad(f"steps[{i}].args", "the workdir is empty or has leading/trailing spaces",
                       "give an absolute path")
        return [f"WORKDIR {path}"]
    if kind == "USER":
        return [f"USER {_user(_args(i, step, 1)[0], f'steps[{i}].args')}"]
    raise Unsupported(f"steps[{i}].type: {str(kind)[:40]!r} is not a step dsec can build",
                      field=f"steps[{i}].type", fix="use RUN, COPY, ENV, WORKDIR or USER steps")


def _copy(i: int, step: dict[str, Any], out: Plan) -> str:
    args = _args(i, step, 2)
    src, dest = args[0], args[1]
    owner = args[2] if len(args) > 2 else ""
    mode = args[3] if len(args) > 3 else ""
    digest = step.get("filesHash")
    if not isinstance(digest, str) or not HASH_RE.match(digest):
        raise _bad(f"steps[{i}].filesHash", "missing or not a sha256 hex digest", "send the SDK's steps as they are")
    rel = posixpath.normpath(src)
    if posixpath.isabs(src) or rel == ".." or rel.startswith("../"):
        raise _bad(f"steps[{i}].args", f"COPY source {src[:80]!r} is outside the template's directory",
                   "copy paths relative to the template file's directory")
    flags = []
    if owner:
        flags.append(f"--chown={_user(owner, f'steps[{i}].args')}")
    if mode:
        if not _MODE_RE.match(mode):
            raise _bad(f"steps[{i}].args", f"mode {mode[:8]!r} is not octal", "pass mode=0o755 or similar")
        flags.append(f"--chmod={mode}")
    if digest not in out.hashes:
        out.hashes.append(digest)
    sources = [f"{FILES_DIR}/{digest}/{rel}"]
    return " ".join(["COPY", *flags, json.dumps([*sources, dest])])


def _services(body: dict[str, Any], out: Plan, lines: list[str]) -> None:
    """startCmd / readyCmd: scripts in the image that E2B creation runs (control.py), as E2B
    starts them when a sandbox of the template starts."""
    for key, name in (("startCmd", "start.sh"), ("readyCmd", "ready.sh")):
        cmd = body.get(key)
        if cmd is None:
            continue
        if not isinstance(cmd, str):
            raise InvalidArgument(f"{key} must be a string", field=key, fix="pass a shell command")
        out.scripts[f"dsec-template/{name}"] = "#!/bin/sh\n" + cmd + "\n"
    if out.scripts:
        lines.append(f"COPY --chown=0:0 --chmod=0755 {json.dumps(['dsec-template/', SERVICE_DIR + '/'])}")
