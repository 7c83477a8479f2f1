"""Directory watching through the stock e2b SDK (sync `files.watch_dir` polls CreateWatcher /
GetWatcherEvents; async streams WatchDir) against a real dsec server and the agent's inotify."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import AsyncSandbox, Sandbox
from e2b.exceptions import RateLimitException, SandboxException
from e2b.sandbox.filesystem.watch_handle import FilesystemEvent, FilesystemEventType as T

TEMPLATE = "debian-python"


@pytest.fixture(scope="module")
def sbx(e2b_env):
    s = Sandbox.create(TEMPLATE, timeout=600)
    yield s
    s.kill()


def poll_until(handle, want: set[tuple[T, str]], timeout: float = 15.0) -> list[FilesystemEvent]:
    seen: list[FilesystemEvent] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += handle.get_new_events()
        if want <= {(e.type, e.name) for e in seen}:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"missing {want - {(e.type, e.name) for e in seen}}; got {seen}")


def test_sync_watch_reports_changes_until_stopped(sbx):
    sbx.files.make_dir("/tmp/w1")
    h = sbx.files.watch_dir("/tmp/w1")
    sbx.files.write("/tmp/w1/a.txt", "one")         # the file API: a temporary file renamed into place
    sbx.commands.run("cd /tmp/w1 && echo more >> a.txt && chmod 600 a.txt && mv a.txt b.txt && rm b.txt")
    seen = poll_until(h, {(T.CREATE, "a.txt"), (T.WRITE, "a.txt"), (T.CHMOD, "a.txt"), (T.RENAME, "a.txt"),
                          (T.CREATE, "b.txt"), (T.REMOVE, "b.txt")})
    assert all(e.entry is None for e in seen)
    h.stop()
    with pytest.raises(SandboxException, match="already stopped"):
        h.get_new_events()


def test_file_api_writes_show_only_the_real_file_name(sbx):
    """files.write is atomic (a temporary sibling renamed into place) yet a watcher sees what a
    plain write makes, as on E2B: CREATE + WRITE of a new file, WRITE of an existing one."""
    sbx.files.make_dir("/tmp/w6")
    h = sbx.files.watch_dir("/tmp/w6")
    sbx.files.write("/tmp/w6/x.txt", "one")
    sbx.files.write("/tmp/w6/x.txt", "two")
    sbx.commands.run("touch /tmp/w6/marker")
    seen = poll_until(h, {(T.CREATE, "marker")})
    h.stop()
    assert [(e.type, e.name) for e in seen if e.name != "marker"] == \
        [(T.CREATE, "x.txt"), (T.WRITE, "x.txt"), (T.WRITE, "x.txt")], seen
    assert sbx.files.read("/tmp/w6/x.txt") == "two"


def test_sync_recursive_watch_follows_new_directories(sbx):
    sbx.files.make_dir("/tmp/w2/existing")
    h = sbx.files.watch_dir("/tmp/w2", recursive=True)
    sbx.commands.run("cd /tmp/w2 && touch existing/f && mkdir -p new/deep && touch new/deep/g")
    poll_until(h, {(T.CREATE, "existing/f"), (T.CREATE, "new"), (T.CREATE, "new/deep/g")})
    h.stop()


def test_watch_as_root_and_refusals(sbx):
    with pytest.raises(SandboxException):
        sbx.files.watch_dir("/root")                  # the sandbox's user may not read it
    h = sbx.files.watch_dir("/root", user="root")
    sbx.commands.run("touch /root/by-root", user="root")
    poll_until(h, {(T.CREATE, "by-root")})
    h.stop()
    for path in ("/proc", "/sys", "/.dsec", "/proc/1/root/tmp"):
        with pytest.raises(SandboxException):
            sbx.files.watch_dir(path, user="root")
    with pytest.raises(SandboxException):
        sbx.files.watch_dir("/tmp/not-there")


def test_watchers_are_bounded_and_stopping_frees_them(sbx):
    sbx.files.make_dir("/tmp/w3")
    handles = [sbx.files.watch_dir("/tmp/w3") for _ in range(16)]
    with pytest.raises(RateLimitException):
        sbx.files.watch_dir("/tmp/w3")
    for h in handles:
        h.stop()
    again = [sbx.files.watch_dir("/tmp/w3") for _ in range(16)]   # every agent watch was freed too
    for h in again:
        h.stop()


def test_another_sandbox_cannot_read_a_watcher(sbx, e2b_env):
    sbx.files.make_dir("/tmp/w4")
    h = sbx.files.watch_dir("/tmp/w4")
    other = Sandbox.create("busybox", timeout=60)
    try:
        r = httpx.post(f"{e2b_env}/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": h._watcher_id},
                       headers={"E2b-Sandbox-Id": other.sandbox_id, "E2b-Sandbox-Port": "49983",
                                "X-Access-Token": other._envd_access_token, "Connect-Protocol-Version": "1"})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
    finally:
        other.kill()
    sbx.commands.run("touch /tmp/w4/mine")
    poll_until(h, {(T.CREATE, "mine")})               # still the owner's
    h.stop()


def test_a_watch_ends_with_its_sandbox(e2b_env):
    s = Sandbox.create("busybox", timeout=60)
    s.files.make_dir("/tmp/w5")
    h = s.files.watch_dir("/tmp/w5")
    s.kill()
    with pytest.raises(SandboxException):
        h.get_new_events()


async def test_async_watch_streams_events_and_ends(e2b_env):
    s = await AsyncSandbox.create(TEMPLATE, timeout=120)
    try:
        await s.files.make_dir("/tmp/aw")
        got: list[FilesystemEvent] = []
        exits: list[Exception | None] = []
        h = await s.files.watch_dir("/tmp/aw", got.append, recursive=True, on_exit=exits.append)
        await s.commands.run("mkdir -p /tmp/aw/sub && echo x > /tmp/aw/sub/file")
        deadline = time.monotonic() + 15
        want = {(T.CREATE, "sub"), (T.CREATE, "sub/file"), (T.WRITE, "sub/file")}
        while not want <= {(e.type, e.name) for e in got} and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert want <= {(e.type, e.name) for e in got}, got
        await h.stop()
        assert exits == [None]
        # a second watch ends, with an error, when the sandbox does
        ended: list[Exception | None] = []
        await s.files.watch_dir("/tmp/aw", lambda e: None, on_exit=ended.append)
    finally:
        await s.kill()
    deadline = time.monotonic() + 15
    while not ended and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert len(ended) == 1 and ended[0] is not None
