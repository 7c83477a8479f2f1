"""The SDK's request bodies carry only what the caller set apart from defaults (and the backend
tag), so a newer client works against an older server that refuses unknown fields."""

from __future__ import annotations

import json

from dsec.sdk.client import wire
from dsec.types import ContainerArgs, ExecRequest, MicroVMArgs, SandboxArgs
from pydantic import TypeAdapter


def test_defaults_stay_out_of_the_body() -> None:
    assert json.loads(wire(ContainerArgs(image="busybox"))) == {"image": "busybox", "backend": "container"}
    assert json.loads(wire(ExecRequest(cmd="true", session=None, keep_stdin=False))) == {"cmd": "true"}


def test_the_backend_tag_is_always_sent() -> None:
    body = json.loads(wire(MicroVMArgs(image="busybox", vcpus=2)))
    assert body == {"image": "busybox", "vcpus": 2, "backend": "microvm"}
    parsed = TypeAdapter(SandboxArgs).validate_python(body)       # the server reads back the same thing
    assert parsed == MicroVMArgs(image="busybox", vcpus=2)


def test_what_the_caller_changed_is_sent() -> None:
    body = json.loads(wire(ContainerArgs(image="busybox", cpu_cores=0.5, labels={"a": "b"}, lifetime_s=60)))
    assert body == {"image": "busybox", "cpu_cores": 0.5, "labels": {"a": "b"}, "lifetime_s": 60.0,
                    "backend": "container"}
