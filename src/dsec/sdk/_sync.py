"""Generate the SDK's blocking API from its async one, so there is one implementation.

All async work runs on a single event loop in a daemon thread, started lazily and shared by
every blocking object; the calling thread blocks on a concurrent future. Consequences: the
blocking API works from any thread (including one that runs its own event loop), objects may
be passed between threads, and connection pools live on one loop.

    class AsyncCounter:
        def __init__(self, start: int = 0):
            self.value = start

        async def add(self, n: int) -> int:
            await asyncio.sleep(0)
            self.value += n
            return self.value

        async def count_to(self, n: int):
            for i in range(n):
                yield i

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

    Counter = synchronize(AsyncCounter)      # name: "Counter" (the "Async" prefix dropped)

    with Counter(1) as c:
        c.add(2)                  # -> 3, blocking
        list(c.count_to(3))       # -> [0, 1, 2], a plain iterator
        c.value                   # -> 3, attributes pass through

Mapping from async to blocking:
  * coroutine methods / classmethods / staticmethods -> blocking calls;
  * async-generator methods (and any method returning an async iterator) -> plain iterators;
  * __aenter__/__aexit__ -> __enter__/__exit__; __aiter__ -> __iter__;
  * properties and attributes pass through (reads and writes go to the async object);
  * return values (also inside lists, tuples and dict values) that are instances of another
    synchronized async class come back as that class's blocking wrapper; blocking wrappers
    passed as arguments are unwrapped to their async objects;
  * exceptions propagate unchanged (same object, same type).
Names starting with "_" are not generated, but remain reachable through attribute fallback.

The SDK's own blocking classes (dsec.sdk.sync) are not built with synchronize() at import time:
they are typed source written by dsec.sdk._gen_sync, whose methods call register(), construct(),
call() and get_attr() below, so both ways share this one runtime.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

log = logging.getLogger("dsec.sdk.sync")

T = TypeVar("T")
S = TypeVar("S", bound="Synchronized")

# ---------------------------------------------------------------------------------------
# The shared background loop.
# ---------------------------------------------------------------------------------------

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_pid: int | None = None


def _get_loop() -> asyncio.AbstractEventLoop:
    global _loop, _loop_thread, _loop_pid
    with _loop_lock:
        # After fork() the child has the loop object but not its thread: start a fresh one.
        if _loop is None or _loop_pid != os.getpid() or not _loop_thread or not _loop_thread.is_alive():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=serve, name="dsec-sync-loop", daemon=True)
            thread.start()
            ready.wait()
            _loop, _loop_thread, _loop_pid = loop, thread, os.getpid()
        return _loop


def _in_loop_thread() -> bool:
    return _loop_thread is not None and threading.current_thread() is _loop_thread


def run(aw: Awaitable[T]) -> T:
    """Run an awaitable on the shared loop and block until it finishes."""
    if _in_loop_thread():
        if inspect.iscoroutine(aw):
            aw.close()   # avoid a "never awaited" warning on top of the real error
        raise RuntimeError("a blocking dsec API was called from async code running on the "
                           "synchronizer's own loop; use the async API there (await it)")
    coro: Coroutine[Any, Any, T] = aw if inspect.iscoroutine(aw) else _await(aw)
    fut = asyncio.run_coroutine_threadsafe(coro, _get_loop())
    try:
        return fut.result()
    except BaseException:
        # KeyboardInterrupt and friends: do not leave the work running behind the caller.
        fut.cancel()
        raise


async def _await(aw: Awaitable[T]) -> T:
    return await aw


# ---------------------------------------------------------------------------------------
# Wrapping values.
# ---------------------------------------------------------------------------------------

_SYNC_BY_ASYNC: dict[type, type[Synchronized]] = {}


class Synchronized:
    """Base of every generated blocking class; holds the async object in `_impl`."""

    _async_cls: ClassVar[type] = object
    __slots__ = ("_impl",)
    _impl: Any

    @classmethod
    def _from_impl(cls: type[S], impl: Any) -> S:
        obj = object.__new__(cls)
        object.__setattr__(obj, "_impl", impl)
        return obj

    # Hidden from type checkers: with them, any attribute name would type-check as Any, and a
    # typo on a generated class (whose attributes are all declared) would go unnoticed.
    if not TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any:
            # Only reached for names not generated on the class: instance attributes of the
            # async object (e.g. `sbx.info`, `sbx.files`) and private helpers.
            if name == "_impl":
                raise AttributeError(name)
            return _attr_value(getattr(self._impl, name))

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(self._impl, name, unwrap(value))

        def __delattr__(self, name: str) -> None:
            delattr(self._impl, name)

    def __repr__(self) -> str:
        return f"<blocking {self._impl!r}>"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Synchronized):
            return self._impl is other._impl
        return NotImplemented

    def __hash__(self) -> int:
        return id(self._impl)


def wrap(value: Any) -> Any:
    """Async objects of synchronized classes -> their blocking wrappers (recursively into
    lists, tuples and dict values); synchronized async classes -> their blocking classes.
    Containers holding nothing to wrap are returned as they are (same object)."""
    if isinstance(value, type):
        return _SYNC_BY_ASYNC.get(value, value)
    if isinstance(value, (list, tuple, dict)):
        return _map_container(value, wrap)
    sync_cls = _sync_class_for(type(value))
    return sync_cls._from_impl(value) if sync_cls is not None else value


def unwrap(value: Any) -> Any:
    """The inverse of wrap(), for arguments passed into the async implementation. A list
    or dict argument without wrappers in it is passed as is, so callees may mutate it."""
    if isinstance(value, Synchronized):
        return object.__getattribute__(value, "_impl")
    if isinstance(value, (list, tuple, dict)):
        return _map_container(value, unwrap)
    return value


def _map_container(value: list[Any] | tuple[Any, ...] | dict[Any, Any], fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        mapped = {k: fn(v) for k, v in value.items()}
        changed = any(mapped[k] is not v for k, v in value.items())
        return mapped if changed else value
    items = [fn(v) for v in value]
    if all(a is b for a, b in zip(items, value)):
        return value
    if isinstance(value, list):
        return items
    if hasattr(value, "_fields"):          # namedtuple
        return type(value)(*items)
    return tuple(items)


def _attr_value(value: Any) -> Any:
    """An attribute read off an async object: callables become blocking callables."""
    if callable(value) and not isinstance(value, type) and _sync_class_for(type(value)) is None:
        return _blocking_callable(value)
    return wrap(value)


def _sync_class_for(cls: type) -> type[Synchronized] | None:
    for base in cls.__mro__:   # a subclass falls back to its nearest synchronized base
        sync_cls = _SYNC_BY_ASYNC.get(base)
        if sync_cls is not None:
            return sync_cls
    return None


def _resolve(result: Any, *, impl: Any = None, wrapper: Any = None) -> Any:
    """Turn what an async method returned into its blocking equivalent."""
    if inspect.isawaitable(result) and _sync_class_for(type(result)) is None:
        result = run(result)
    elif isinstance(result, AsyncIterator) and _sync_class_for(type(result)) is None:
        return _iterate(result)
    if wrapper is not None and result is impl:
        return wrapper   # keep identity for `with X() as x` and fluent `return self`
    return wrap(result)


def _iterate(agen: AsyncIterator[Any]) -> Iterator[Any]:
    """Drive an async iterator from the calling thread, one item per round trip."""
    try:
        while True:
            try:
                item = run(_anext(agen))
            except StopAsyncIteration:
                return
            yield wrap(item)
    finally:
        # Early break / close(): finish the async generator's cleanup on its loop. If we are
        # being finalised on the loop thread itself, asyncio's asyncgen hooks close it.
        if hasattr(agen, "aclose") and not _in_loop_thread():
            run(_aclose(agen))


# __anext__()/aclose() are called on the loop thread: that is where asyncio's async-generator
# hooks are installed, so the generator is finalised by the right loop if it is dropped.
async def _anext(agen: AsyncIterator[Any]) -> Any:
    return await agen.__anext__()


async def _aclose(agen: Any) -> None:
    await agen.aclose()


def _unwrap_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(unwrap(a) for a in args), {k: unwrap(v) for k, v in kwargs.items()}


def _blocking_callable(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        a, kw = _unwrap_args(args, kwargs)
        return _resolve(fn(*a, **kw))
    return call


# ---------------------------------------------------------------------------------------
# What a blocking class's members do: used by the generated source (dsec.sdk.sync) and by
# synchronize(). Their own parameters are positional-only so any keyword passes through.
# ---------------------------------------------------------------------------------------


def register(async_cls: type) -> Callable[[type[S]], type[S]]:
    """Class decorator: the decorated blocking class wraps async_cls's objects (return values
    of type async_cls, or a subclass, come back as it)."""
    def deco(sync_cls: type[S]) -> type[S]:
        sync_cls._async_cls = async_cls
        _SYNC_BY_ASYNC[async_cls] = sync_cls
        return sync_cls
    return deco


def construct(wrapper: Synchronized, /, *args: Any, **kwargs: Any) -> None:
    """__init__ of a blocking class: build its async object (on the shared loop)."""
    a, kw = _unwrap_args(args, kwargs)
    object.__setattr__(wrapper, "_impl", run(_construct(type(wrapper)._async_cls, a, kw)))


def call(wrapper: Synchronized, method: str, /, *args: Any, **kwargs: Any) -> Any:
    """A blocking method: call the async object's `method`, run the coroutine to its end (or
    iterate what it yields), and wrap the result."""
    impl = object.__getattribute__(wrapper, "_impl")
    a, kw = _unwrap_args(args, kwargs)
    # getattr at call time honours subclasses and per-instance overrides of the method.
    return _resolve(getattr(impl, method)(*a, **kw), impl=impl, wrapper=wrapper)


def get_attr(wrapper: Synchronized, name: str, /) -> Any:
    """A property read: the async object's attribute, wrapped."""
    return wrap(getattr(object.__getattribute__(wrapper, "_impl"), name))


def set_attr(wrapper: Synchronized, name: str, value: Any, /) -> None:
    setattr(object.__getattribute__(wrapper, "_impl"), name, unwrap(value))


# ---------------------------------------------------------------------------------------
# Generating the blocking class at run time (for async classes outside the SDK).
# ---------------------------------------------------------------------------------------


def _method(name: str, fn: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self: Synchronized, *args: Any, **kwargs: Any) -> Any:
        return call(self, name, *args, **kwargs)
    method.__qualname__ = qualname
    return method


def _classmethod(name: str, fn: Callable[..., Any], qualname: str) -> classmethod[Any, Any, Any]:
    @functools.wraps(fn)
    def method(cls: type[Synchronized], *args: Any, **kwargs: Any) -> Any:
        a, kw = _unwrap_args(args, kwargs)
        return _resolve(getattr(cls._async_cls, name)(*a, **kw))
    method.__qualname__ = qualname
    return classmethod(method)


def _staticmethod(fn: Callable[..., Any], qualname: str) -> staticmethod[Any, Any]:
    call = _blocking_callable(fn)
    call.__qualname__ = qualname
    return staticmethod(call)


def _property(name: str, prop: property) -> property:
    def fget(self: Synchronized) -> Any:
        return get_attr(self, name)

    def fset(self: Synchronized, value: Any) -> None:
        set_attr(self, name, value)

    def fdel(self: Synchronized) -> None:
        delattr(self._impl, name)

    return property(fget, fset if prop.fset else None, fdel if prop.fdel else None, prop.__doc__)


class _ClassAttr:
    """A class-level attribute of the async class: read from the class (on the blocking
    class) or from the async instance (so instance overrides are seen)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Synchronized | None, owner: type[Synchronized]) -> Any:
        if obj is None:
            return wrap(getattr(owner._async_cls, self.name))
        return _attr_value(getattr(obj._impl, self.name))

    def __set__(self, obj: Synchronized, value: Any) -> None:
        setattr(obj._impl, self.name, unwrap(value))


def _construct(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Coroutine[Any, Any, Any]:
    async def build() -> Any:
        # Built on the loop thread: constructors that grab the running loop or create
        # loop-bound primitives get the loop the object will be used on.
        return cls(*args, **kwargs)
    return build()


def synchronize(async_cls: type, *, name: str | None = None, module: str | None = None) -> type[Synchronized]:
    """Return (and register) the blocking twin of async_cls.

    name defaults to async_cls's name without a leading "Async" or "_" ("AsyncSandbox" ->
    "Sandbox"), else "Blocking" + name. Synchronizing the same class twice returns the same
    blocking class.
    """
    if async_cls in _SYNC_BY_ASYNC:
        return _SYNC_BY_ASYNC[async_cls]
    if name is None:
        n = async_cls.__name__
        name = n[5:] if n.startswith("Async") and len(n) > 5 else n.lstrip("_") if n.startswith("_") else "Blocking" + n
    bases = tuple(_SYNC_BY_ASYNC[b] for b in async_cls.__bases__ if b in _SYNC_BY_ASYNC) or (Synchronized,)
    ns: dict[str, Any] = {
        "__doc__": async_cls.__doc__,
        "__module__": module or async_cls.__module__,
        "__slots__": (),
        "_async_cls": async_cls,
    }

    def __init__(self: Synchronized, *args: Any, **kwargs: Any) -> None:
        construct(self, *args, **kwargs)

    init_src = inspect.getattr_static(async_cls, "__init__", None)
    if callable(init_src) and init_src is not object.__init__:
        __init__ = functools.wraps(init_src)(__init__)
    __init__.__qualname__ = f"{name}.__init__"
    ns["__init__"] = __init__

    for attr in dir(async_cls):
        if attr.startswith("_"):
            continue
        static = inspect.getattr_static(async_cls, attr)
        qual = f"{name}.{attr}"
        if isinstance(static, staticmethod):
            ns[attr] = _staticmethod(static.__func__, qual)
        elif isinstance(static, classmethod):
            ns[attr] = _classmethod(attr, static.__func__, qual)
        elif isinstance(static, property):
            ns[attr] = _property(attr, static)
        elif inspect.isfunction(static):
            ns[attr] = _method(attr, static, qual)
        else:
            ns[attr] = _ClassAttr(attr)

    if hasattr(async_cls, "__aenter__"):
        def __enter__(self: Synchronized) -> Any:
            return call(self, "__aenter__")

        def __exit__(self: Synchronized, exc_type: Any, exc: Any, tb: Any) -> Any:
            return call(self, "__aexit__", exc_type, exc, tb)

        ns["__enter__"], ns["__exit__"] = __enter__, __exit__

    if hasattr(async_cls, "__aiter__"):
        def __iter__(self: Synchronized) -> Iterator[Any]:
            return _iterate(self._impl.__aiter__())

        ns["__iter__"] = __iter__

    sync_cls: type[Synchronized] = type(name, bases, ns)
    register(async_cls)(sync_cls)
    log.debug("synchronized %s.%s as %s", async_cls.__module__, async_cls.__qualname__, name)
    return sync_cls


def blocking_class_of(async_cls: type) -> type[Synchronized] | None:
    """The blocking class registered for async_cls (or its nearest base), if any."""
    return _sync_class_for(async_cls)


def async_object(obj: Synchronized) -> Any:
    """The async object behind a blocking wrapper (to mix the two APIs deliberately)."""
    return object.__getattribute__(obj, "_impl")
