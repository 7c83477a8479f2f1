"""A burst's small control-store writes, grouped into one transaction per thread hop (D97).

Every create through the apiserver writes the control store four times (idempotency claim,
quota reservation, its activation, the claim's bind), each in its own thread hop and commit.
A burst of 50 creates made 200 hops and 200 commits, one after another on the store's one
connection; py-spy put those hops at ~15% of a pooled burst's event loop (D93).

Here a call queues its function; one drain task per event loop runs whatever is queued in
one hop, in one transaction, each function under its own SAVEPOINT (so one that raises,
e.g. a QuotaExceeded after its UPDATE, rolls back alone and gets its own exception; an error
of the transaction itself, a deadlock with another replica's batch, fails and retries it whole), and
hands every caller its result after the COMMIT. Alone, a call costs what `to_thread` did
(one hop, one commit); under a burst, the calls that arrive while a batch runs share the
next one. A caller cancelled before its batch starts is dropped, so nothing of it is written.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from dsec.store.db import Database, Tx

T = TypeVar("T")
MAX_BATCH = 64       # functions per transaction: bounds how long the connection is held at once

_Item = tuple[Callable[[], Any], "asyncio.Future[Any]"]


class TxBatcher:
    def __init__(self, db: Database):
        self.db = db
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: list[_Item] = []
        self._draining = False
        self.batches = 0       # transactions run (a test and the bench read these)
        self.calls = 0

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a write transaction shared with the calls queued beside it. fn reaches
        the store through `db.run`, which joins the batch's transaction (Database.run)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:       # a new event loop (tests, a restarted server): fresh state
            self._loop, self._queue, self._draining = loop, [], False
        fut: asyncio.Future[T] = loop.create_future()
        self._queue.append(((lambda: fn(*args)), fut))
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain(loop), name="store-batch")
        return await fut

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._queue and self._loop is loop:
                batch = [it for it in self._queue[:MAX_BATCH] if not it[1].cancelled()]
                del self._queue[:MAX_BATCH]
                if not batch:
                    continue
                try:
                    outcomes = await asyncio.to_thread(self._run, [fn for fn, _ in batch])
                except BaseException as e:     # the transaction as a whole failed (commit, a lock)
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                for (_, fut), (ok, value) in zip(batch, outcomes):
                    if fut.done():             # its caller gave up while it ran: written all the same
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(value)
        finally:
            if self._loop is loop:
                self._draining = False
                if self._queue:                # queued after a failure ended this drain
                    self._draining = True
                    loop.create_task(self._drain(loop), name="store-batch")

    def _run(self, fns: list[Callable[[], Any]]) -> list[tuple[bool, Any]]:
        self.batches += 1
        self.calls += len(fns)
        if len(fns) == 1:                  # alone: exactly what a direct db.run does
            try:
                return [(True, self.db.run(lambda _tx: fns[0]()))]
            except Exception as e:  # noqa: BLE001 - handed to its caller, as to_thread would
                return [(False, e)]
        return self.db.run(lambda tx: [_savepointed(self.db, tx, fn) for fn in fns])


def _savepointed(db: Database, tx: Tx, fn: Callable[[], Any]) -> tuple[bool, Any]:
    tx.execute("SAVEPOINT dsec_batch")
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - this call's own error, handed to its caller
        if db.fails_whole_transaction(e):
            # a deadlock between two replicas' batches (each claims keys the other holds): the
            # whole transaction is the victim; db.run rolls it back and runs every call again
            raise
        tx.execute("ROLLBACK TO SAVEPOINT dsec_batch")
        tx.execute("RELEASE SAVEPOINT dsec_batch")
        return False, e
    tx.execute("RELEASE SAVEPOINT dsec_batch")
    return True, out


_batchers: weakref.WeakKeyDictionary[Database, TxBatcher] = weakref.WeakKeyDictionary()


def batcher(db: Database) -> TxBatcher:
    """The one batcher of this database (per process)."""
    b = _batchers.get(db)
    if b is None:
        b = _batchers[db] = TxBatcher(db)
    return b
