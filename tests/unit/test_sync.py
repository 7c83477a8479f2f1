import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from dsec.sdk._sync import Synchronized, async_object, blocking_class_of, synchronize


class AsyncFiles:
    """A namespace object, like sbx.files."""

    def __init__(self, owner: "AsyncBox"):
        self.owner = owner

    async def write(self, path: str, data: str) -> int:
        await asyncio.sleep(0)
        self.owner.store[path] = data
        return len(data)

    async def read(self, path: str) -> str:
        await asyncio.sleep(0)
        try:
            return self.owner.store[path]
        except KeyError:
            raise FileNotFoundError(path) from None


class Pair(NamedTuple):
    first: object
    second: object


class AsyncBox:
    """An async resource."""

    kind = "box"

    def __init__(self, name: str = "b0"):
        self.name = name
        self.store: dict[str, str] = {}
        self.files = AsyncFiles(self)
        self.entered = self.exited = False
        # Constructed on the synchronizer's loop, so this works.
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()

    @classmethod
    async def create(cls, name: str) -> "AsyncBox":
        await asyncio.sleep(0)
        return cls(name)

    @staticmethod
    async def version() -> str:
        return "1.0"

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.name}"

    @label.setter
    def label(self, value: str) -> None:
        self.name = value.split(":", 1)[1]

    def plain(self, x: int) -> int:
        return x * 2

    async def echo(self, x: str) -> str:
        async with self.lock:
            assert asyncio.get_running_loop() is self.loop
            await asyncio.sleep(0.001)
            return x

    async def fail(self) -> None:
        raise KeyError("nope")

    async def lines(self, n: int):
        for i in range(n):
            await asyncio.sleep(0)
            yield f"line {i}"

    async def guarded(self, log: list[str]):
        try:
            for i in range(100):
                yield i
        finally:
            log.append("cleaned up")

    async def child(self, name: str) -> "AsyncBox":
        return AsyncBox(name)

    async def children(self, n: int) -> list["AsyncBox"]:
        return [AsyncBox(f"c{i}") for i in range(n)]

    async def pair(self) -> Pair:
        return Pair(AsyncBox("p1"), 42)

    async def by_name(self) -> dict[str, "AsyncBox"]:
        return {"x": AsyncBox("x")}

    async def same(self, other: "AsyncBox") -> bool:
        return other is self

    async def chain(self) -> "AsyncBox":
        return self

    async def __aenter__(self) -> "AsyncBox":
        self.entered = True
        return self

    async def __aexit__(self, *exc) -> None:
        self.exited = True

    async def _private(self) -> str:
        return "private"


class AsyncBigBox(AsyncBox):
    async def size(self) -> int:
        return 3


class AsyncTicker:
    def __init__(self, n: int):
        self.n = n

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for i in range(self.n):
            yield i


Box = synchronize(AsyncBox)
Files = synchronize(AsyncFiles)
BigBox = synchronize(AsyncBigBox)
Ticker = synchronize(AsyncTicker, name="Ticker")


def test_names_and_registry():
    assert Box.__name__ == "Box" and Files.__name__ == "Files"
    assert synchronize(type("Thing", (), {})).__name__ == "BlockingThing"
    assert synchronize(AsyncBox) is Box
    assert blocking_class_of(AsyncBox) is Box
    assert issubclass(BigBox, Box) and issubclass(Box, Synchronized)
    assert Box.__doc__ == AsyncBox.__doc__
    assert Box.echo.__doc__ == AsyncBox.echo.__doc__ and Box.echo.__qualname__ == "Box.echo"


def test_blocking_methods_and_attributes():
    b = Box("one")
    assert isinstance(async_object(b), AsyncBox)
    assert b.echo("hi") == "hi"
    assert b.plain(21) == 42
    assert b.name == "one" and b.kind == "box" and Box.kind == "box"
    assert b.label == "box:one"
    b.label = "box:two"
    assert b.name == "two"
    b.name = "three"
    assert async_object(b).name == "three"
    assert b._private() == "private"   # not generated, but reachable


def test_classmethods_staticmethods_and_subclasses():
    b = Box.create("made")
    assert isinstance(b, Box) and b.name == "made"
    assert Box.version() == "1.0"
    big = BigBox.create("big")
    assert isinstance(big, BigBox) and big.size() == 3 and big.echo("x") == "x"


def test_exceptions_propagate_unchanged():
    b = Box()
    with pytest.raises(KeyError, match="nope"):
        b.fail()
    with pytest.raises(FileNotFoundError):
        b.files.read("/missing")


def test_async_generators_become_iterators():
    b = Box()
    it = b.lines(3)
    assert iter(it) is it
    assert list(it) == ["line 0", "line 1", "line 2"]
    assert list(Ticker(4)) == [0, 1, 2, 3]


def test_breaking_out_of_iterator_runs_async_cleanup():
    b = Box()
    log: list[str] = []
    it = b.guarded(log)
    for i in it:
        if i == 2:
            break
    it.close()
    assert log == ["cleaned up"]
    # Dropping an unfinished iterator also finishes the async generator.
    it = b.guarded(log)
    assert next(it) == 0
    del it
    assert log == ["cleaned up"] * 2


def test_context_manager_and_identity():
    with Box("cm") as b:
        assert isinstance(b, Box)
        assert async_object(b).entered
        assert b.chain() is b
    assert async_object(b).exited


def test_context_manager_exit_sees_the_exception():
    seen = []

    class AsyncRes:
        async def __aenter__(self):
            return self

        async def __aexit__(self, exc_type, exc, tb):
            seen.append(exc_type)
            return False

    Res = synchronize(AsyncRes)
    with pytest.raises(ValueError):
        with Res():
            raise ValueError("inside")
    assert seen == [ValueError]


def test_returned_objects_are_wrapped_recursively():
    b = Box()
    c = b.child("kid")
    assert isinstance(c, Box) and c.echo("k") == "k"
    kids = b.children(3)
    assert isinstance(kids, list) and all(isinstance(k, Box) for k in kids)
    assert [k.name for k in kids] == ["c0", "c1", "c2"]
    p = b.pair()
    assert isinstance(p, Pair) and isinstance(p.first, Box) and p.second == 42
    assert isinstance(b.by_name()["x"], Box)
    # Namespace attributes are wrapped too, and wrappers passed back in are unwrapped.
    assert isinstance(b.files, Files)
    assert b.files.write("/a", "hello") == 5 and b.files.read("/a") == "hello"
    assert b.same(b) and not b.same(c)
    assert b == Box._from_impl(async_object(b)) and hash(b) == hash(Box._from_impl(async_object(b)))


def test_usable_from_many_threads():
    b = Box()

    def work(i: int) -> str:
        assert threading.current_thread() is not threading.main_thread()
        with Box(f"t{i}") as own:
            own.files.write("/x", str(i))
            assert list(own.lines(2)) == ["line 0", "line 1"]
            return b.echo(own.files.read("/x"))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(32)))
    assert results == [str(i) for i in range(32)]


async def test_usable_from_a_thread_running_its_own_loop():
    # Blocking from inside another event loop is legal (it blocks that loop): the work runs
    # on the synchronizer's loop, not this one.
    b = Box()
    assert b.echo("from async test") == "from async test"
    assert async_object(b).loop is not asyncio.get_running_loop()


def test_calling_blocking_api_from_the_sync_loop_is_an_error():
    class AsyncNested:
        async def inner(self) -> str:
            return Box().echo("never")   # blocking call on the loop thread: would deadlock

    Nested = synchronize(AsyncNested)
    with pytest.raises(RuntimeError, match="use the async API"):
        Nested().inner()
