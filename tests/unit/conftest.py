"""Fixtures of the no-root unit tests: the edge's logic on a fake backend and an agent stub.

Nothing here needs root, crun or QEMU, and nothing uses the server fixtures of
tests/conftest.py (they are requested by name only, never autouse).
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec.agent.client import AgentClient
from dsec.config import Paths
from dsec.edge import edge as edge_module
from dsec.edge.edge import Edge
from dsec.images.service import ImageService
from dsec.testing.agent_stub import AgentStub
from dsec.testing.fake_backend import FakeBackend, ParkingFakeBackend

from ._helpers import Clock, Node


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: unix socket paths are limited to 107 bytes, and pytest's
    tmp_path can be longer than that."""
    d = Path(tempfile.mkdtemp(prefix="dsec-u-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def stub(short_tmp: Path) -> AsyncIterator[AgentStub]:
    s = AgentStub(short_tmp / "agent.sock", short_tmp / "root")
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def agent(stub: AgentStub) -> AsyncIterator[AgentClient]:
    client = await AgentClient.connect(stub.socket_path)
    yield client
    await client.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    for part in edge_module.PARTS:      # every part of the edge that reads the clock
        module = importlib.import_module(f"dsec.edge.{part}")
        if hasattr(module, "time"):
            monkeypatch.setattr(module, "time", c)
    return c


@pytest.fixture
def image_service(short_tmp: Path) -> ImageService:
    """A real ImageService on a throw-away home (no root needed: no image is built or mounted)."""
    return ImageService(Paths(short_tmp / "home"))


@pytest.fixture
async def fake(short_tmp: Path) -> AsyncIterator[FakeBackend]:
    b = FakeBackend(short_tmp / "rt")
    yield b
    await b.close()


@pytest.fixture
async def parking(short_tmp: Path) -> AsyncIterator[ParkingFakeBackend]:
    b = ParkingFakeBackend(short_tmp / "vm", kinds=("microvm",))
    yield b
    await b.close()


@pytest.fixture
async def node(image_service: ImageService, fake: FakeBackend,
               parking: ParkingFakeBackend) -> AsyncIterator[Node]:
    n = Node(image_service.paths, image_service, [fake, parking])
    yield n
    await n.stop_edge()


@pytest.fixture
async def edge(node: Node) -> Edge:
    return await node.start()
