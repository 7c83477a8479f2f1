#!/usr/bin/python3
"""dsec's Jupyter kernels for JavaScript and bash, for the code-interpreter image.

Debian has no ijavascript and no bash_kernel, and image builds have no network (no npm or pip
inside), so these two are ipykernel "wrapper kernels" (ipykernel.kernelbase.Kernel, Debian's
python3-ipykernel) around one long-lived child each:

  javascript  `node code_interpreter_node.js`: every cell runs in the same V8 realm, so state
              (let/const/var, functions, required modules) stays across cells; the last
              expression's value comes back as text (util.inspect), a Promise is awaited first.
  bash        `bash --noprofile --norc`: every cell is sourced by the same shell, so variables,
              functions and the working directory stay across cells.

The child's stdout and stderr are streamed as Jupyter stream messages while the cell runs; the
end of a cell (and its value or error) comes back on a separate pipe (fd $DSEC_CTL_FD in the child), so
nothing the user prints can forge it. dsec-code-interpreter (code_interpreter_server.py) starts
these with jupyter_client like any kernel (kernelspecs under /usr/local/share/jupyter/kernels),
so timeouts, interrupts (SIGINT) and restarts work as for Python. Stdlib + ipykernel only.

Usage (kernel.json argv): code_interpreter_kernels.py javascript|bash -f {connection_file}
"""

from __future__ import annotations

import codecs
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

HERE = os.path.dirname(os.path.abspath(__file__))
NODE_DRIVER = os.path.join(HERE, "code_interpreter_node.js")
INTERRUPT_WAIT_S = 3.0      # a child that does not end its cell by then after SIGINT is restarted


class Child:
    """One long-lived interpreter: commands on its stdin, cell ends on fd $DSEC_CTL_FD."""

    def __init__(self, argv: list[str]):
        # the child stays in the kernel's process group: jupyter_client signals the group, so
        # an interrupt (SIGINT) reaches the running code and a kill takes the child along
        ctl_r, ctl_w = os.pipe()
        env = dict(os.environ, DSEC_CTL_FD=str(ctl_w))
        # ipykernel ignores SIGINT between requests, and an ignored signal stays ignored across
        # exec (bash could not even trap it): a handler now means SIG_DFL in the child
        try:
            old = signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:          # not the main thread
            old = None
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, pass_fds=(ctl_w,), env=env)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        os.close(ctl_w)
        self.ctl = ctl_r
        self.ctl_buf = b""
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace")
                         for name in ("stdout", "stderr")}

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        os.close(self.ctl)

    def run(self, stream) -> dict | None:
        """Pump stdout/stderr to stream(name, text) until the cell's end line on the control
        pipe. Returns that line as a dict ("interrupted": True added after a SIGINT; "stuck":
        True when the child did not end the cell within INTERRUPT_WAIT_S of it), or None when
        the child died."""
        out, err = self.proc.stdout, self.proc.stderr
        assert out is not None and err is not None
        fds = {out.fileno(): "stdout", err.fileno(): "stderr", self.ctl: "ctl"}
        sigint_at = None
        while True:
            try:
                ready, _, _ = select.select(list(fds), [], [], 0.2)
            except KeyboardInterrupt:
                ready = []
                if sigint_at is None:       # the group's SIGINT reached the child too
                    sigint_at = time.monotonic()
            if sigint_at is not None and time.monotonic() - sigint_at > INTERRUPT_WAIT_S:
                return {"interrupted": True, "stuck": True}
            for fd in ready:
                data = os.read(fd, 65536)
                if fds[fd] == "ctl":
                    if not data:
                        return None
                    self.ctl_buf += data
                    if b"\n" in self.ctl_buf:
                        line, self.ctl_buf = self.ctl_buf.split(b"\n", 1)
                        self._drain(stream)
                        end = json.loads(line)
                        if sigint_at is not None:
                            end["interrupted"] = True
                        return end
                elif data:
                    stream(fds[fd], self.decoders[fds[fd]].decode(data))
                else:
                    del fds[fd]
            if self.proc.poll() is not None and not ready:
                self._drain(stream)
                return None

    def _drain(self, stream) -> None:
        for f, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            assert f is not None
            while select.select([f], [], [], 0)[0]:
                data = os.read(f.fileno(), 65536)
                if not data:
                    break
                stream(name, self.decoders[name].decode(data))


class ChildKernel(Kernel):
    """A Jupyter kernel whose cells run in a Child; subclasses say how."""

    banner = ""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.child: Child | None = None

    def start_child(self) -> Child:
        raise NotImplementedError

    def command(self, code: str) -> str:
        raise NotImplementedError

    def _stream(self, silent: bool):
        def send(name: str, text: str) -> None:
            if not silent and text:
                self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})
        return send

    def _error(self, ename: str, evalue: str, traceback: list[str], silent: bool) -> dict:
        content = {"ename": ename, "evalue": evalue, "traceback": traceback}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}

    def do_execute(self, code, silent, store_history=True, user_expressions=None,
                   allow_stdin=False, *, cell_id=None):
        if self.child is None or self.child.proc.poll() is not None:
            self.child = self.start_child()
        try:
            self.child.send(self.command(code))
        except BrokenPipeError:
            self.child = None
            return self._error("DeadKernelError", "the interpreter exited; run the cell again",
                               [], silent)
        end = self.child.run(self._stream(silent))
        if end is None:                 # the interpreter exited (e.g. `exit` in bash)
            code_ = self.child.proc.wait()
            self.child.kill()
            self.child = None
            return self._error("InterpreterExited",
                               f"the interpreter exited (status {code_}); its state is lost and "
                               "the next cell starts a fresh one", [], silent)
        if end.get("stuck"):
            self.child.kill()
            self.child = None
            return self._error("KeyboardInterrupt", "interrupted; the interpreter did not stop "
                               "and was restarted, its state is lost", [], silent)
        if end.get("interrupted"):
            return self._error("KeyboardInterrupt", "interrupted", [], silent)
        if end.get("error"):
            e = end["error"]
            return self._error(e.get("name", "Error"), e.get("value", ""),
                               [e.get("traceback") or f"{e.get('name')}: {e.get('value')}"], silent)
        if not silent and end.get("value") is not None:
            self.send_response(self.iopub_socket, "execute_result", {
                "execution_count": self.execution_count,
                "data": {"text/plain": end["value"]}, "metadata": {}})
        return {"status": "ok", "execution_count": self.execution_count, "payload": [],
                "user_expressions": {}}

    def do_shutdown(self, restart):
        if self.child is not None:
            self.child.kill()
            self.child = None
        return {"status": "ok", "restart": restart}


class JavaScriptKernel(ChildKernel):
    implementation = "dsec-javascript"
    implementation_version = "1"
    language = "javascript"
    language_version = ""
    language_info = {"name": "javascript", "mimetype": "application/javascript",
                     "file_extension": ".js"}

    def start_child(self) -> Child:
        return Child(["node", NODE_DRIVER])

    def command(self, code: str) -> str:
        return json.dumps({"code": code})


class BashKernel(ChildKernel):
    implementation = "dsec-bash"
    implementation_version = "1"
    language = "bash"
    language_version = ""
    language_info = {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh"}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cells = tempfile.mkdtemp(prefix="dsec-bash-kernel-")

    def start_child(self) -> Child:
        # SIGINT ends the cell being sourced (return from `.`), not the shell
        child = Child(["bash", "--noprofile", "--norc"])
        child.send("trap 'return 130 2>/dev/null' INT")
        return child

    def command(self, code: str) -> str:
        path = os.path.join(self.cells, "cell.sh")
        with open(path, "w") as f:
            f.write(code if code.endswith("\n") else code + "\n")
        # one line: source the cell, then its status on fd 3 (the kernel's end marker)
        return (f". {path} </dev/null; __dsec_rc=$?; "
                "printf '{\"status\": %d}\\n' \"$__dsec_rc\" >&$DSEC_CTL_FD")


KERNELS = {"javascript": JavaScriptKernel, "bash": BashKernel}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in KERNELS:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(KERNELS)} -f CONNECTION_FILE")
    kernel = KERNELS[sys.argv.pop(1)]
    IPKernelApp.launch_instance(kernel_class=kernel)


if __name__ == "__main__":
    main()
