"""Interactive terminals with the stock e2b SDK (PyPI `e2b`, `sandbox.pty`) against a real dsec
server (issue 24 item 5): envd's Start with a PTY, `pty` output bytes, SendInput with `pty`
bytes, Update (resize) and SendSignal (kill). Before, every one of these answered UNIMPLEMENTED."""

from __future__ import annotations

import asyncio
import re

import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import AsyncSandbox, CommandExitException, PtySize

CURSES_APP = r'''
import curses

def main(scr):
    curses.curs_set(0)
    def show(what):
        rows, cols = scr.getmaxyx()
        scr.erase()
        scr.addstr(0, 0, f"{what} {cols}x{rows}")
        scr.refresh()
    show("start")
    while True:
        k = scr.getch()
        if k == curses.KEY_RESIZE:
            curses.update_lines_cols()
            show("resized")
        elif k == ord("q"):
            return

curses.wrapper(main)
print("curses done")
'''


class Screen:
    """What a PTY printed (on_data), and waiting for a pattern in it."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.seen = 0

    def on_data(self, data: bytes) -> None:
        self.buf += data

    async def expect(self, pattern: bytes, timeout: float = 20.0) -> re.Match:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            m = re.compile(pattern).search(bytes(self.buf), self.seen)
            if m:
                self.seen = m.end()
                return m
            if loop.time() > end:
                raise AssertionError(f"no {pattern!r} in {timeout} s; output: {bytes(self.buf[self.seen:])!r}")
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def sbx(e2b_env):
    s = await AsyncSandbox.create("debian-python", timeout=600)
    yield s
    await s.kill()


async def test_interactive_shell(sbx):
    scr = Screen()
    h = await sbx.pty.create(PtySize(cols=80, rows=24), on_data=scr.on_data)
    assert h.pid > 0
    await sbx.pty.send_stdin(h.pid, b"echo $((6*7)); stty size; echo $TERM; id -un\n")
    await scr.expect(rb"[\r\n]42\r\n24 80\r\nxterm-256color\r\n")
    await sbx.pty.resize(h.pid, PtySize(cols=120, rows=40))
    await sbx.pty.send_stdin(h.pid, b"stty size\n")
    await scr.expect(rb"[\r\n]40 120\r\n")
    assert h.pid in [p.pid for p in await sbx.commands.list()]
    await sbx.pty.send_stdin(h.pid, b"exit\n")
    r = await h.wait()
    assert r.exit_code == 0


async def test_curses_program_resized_while_it_runs(sbx):
    await sbx.files.write("/tmp/app.py", CURSES_APP)
    scr = Screen()
    h = await sbx.pty.create(PtySize(cols=80, rows=24), on_data=scr.on_data)
    await sbx.pty.send_stdin(h.pid, b"python3 /tmp/app.py\n")
    await scr.expect(rb"start 80x24")
    await sbx.pty.resize(h.pid, PtySize(cols=100, rows=30))
    await scr.expect(rb"resized 100x30")
    await sbx.pty.resize(h.pid, PtySize(cols=132, rows=43))
    await scr.expect(rb"resized 132x43")
    await sbx.pty.send_stdin(h.pid, b"q")
    await scr.expect(rb"curses done")
    await sbx.pty.send_stdin(h.pid, b"exit 5\n")
    with pytest.raises(CommandExitException) as e:
        await h.wait()
    assert e.value.exit_code == 5


async def test_kill_and_stream_input(sbx):
    scr = Screen()
    h = await sbx.pty.create(PtySize(cols=80, rows=24), on_data=scr.on_data, envs={"GREETING": "hi"})
    inp = sbx.pty.stream_input(h.pid)
    await inp.send(b"echo $GREETING-")
    await inp.send(b"there; sleep 600\n")
    await inp.close()
    await scr.expect(rb"[\r\n]hi-there\r\n")
    assert await sbx.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        await h.wait()
    assert h.pid not in [p.pid for p in await sbx.commands.list()]
    assert await sbx.pty.kill(h.pid) is False            # gone: not found


async def test_busybox_shell_and_winch_trap(e2b_env):
    """Images without bash get their sh; a trap on WINCH sees the new size."""
    s = await AsyncSandbox.create("busybox", timeout=120)
    try:
        scr = Screen()
        h = await s.pty.create(PtySize(cols=80, rows=24), on_data=scr.on_data)
        await s.pty.send_stdin(h.pid, b"trap 'echo winch $(stty size)' WINCH; echo $((6*7)); stty size\n")
        await scr.expect(rb"42\r\n24 80\r\n")
        await s.pty.send_stdin(h.pid, b"sleep 3 & wait\n")   # the shell in the foreground: it gets WINCH
        await asyncio.sleep(1)
        await s.pty.resize(h.pid, PtySize(cols=90, rows=33))
        await scr.expect(rb"winch 33 90", timeout=15)
        await s.pty.send_stdin(h.pid, b"exit 0\n")      # (`wait` returned 128+SIGWINCH)
        assert (await h.wait()).exit_code == 0
    finally:
        await s.kill()
