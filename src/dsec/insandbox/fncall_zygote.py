"""FnCall zygote: runs inside a warm pool container; stdlib only, copied in by the edge.

Started by the edge as one long-lived agent exec (as root, stdin kept open):

    python3 -I /fncall/zygote.py '<json config>'

Three kinds of processes, so that no call can see another call's data:

  manager (M, this script's main process) reads one JSON request per line on stdin, prepares a
      fresh work dir, runs the steps (compile, run) and cleans up; writes one JSON result per
      line on stdout. It holds call data, but never runs call code and is never forked.
  zygotes (Z, forked from M before any request; one per preload set, e.g. "base" with the
      standard library and "numpy") import modules once, then only fork call processes on
      request. A zygote never holds call data: a request reaches it as a step index plus file
      descriptors (SCM_RIGHTS): a memfd with the spec, the stdin memfd and the pipe ends. So a
      forked child's memory holds nothing of earlier calls. Z is the child subreaper: whatever
      a call leaves behind is reaped there.
  call process (C, forked from Z) reads its spec (still root), sets rlimits, drops to the call
      uid, then either execs the program or runs the Python code in the pre-warmed interpreter.

One call at a time per container (the edge's pool sends the next request only after the
result). After every call M kills every process of the call uid (see Manager._kill_all),
fetches the requested files (regular files below the work dir, no symlinks followed), removes
the uid's SysV IPC objects, the work dir and every entry the uid owns in the shared temp dirs.
A call that cannot be cleaned up makes the result say clean=false and the edge replaces the
container.

Work dirs live on the container's /dev/shm tmpfs when the pool runs no compiled programs (no
disk writes per call; its size caps what a call can write) and on disk otherwise (/dev/shm is
mounted noexec).

Result fields: steps[] (exit_code, signal, timed_out, output_limited, wall_s, cpu_s,
max_rss_kb, stdout/stderr blobs and byte totals, python: 'compiled'|'syntax'|'memory'|None),
files{rel: blob}, clean, error. A blob is {"b64": ...} when small, else {"path": ..., "size": n}
(a root-only file under <work root>/out that the edge reads with FILE_READ before the next call).
"""

import atexit
import base64
import builtins
import ctypes
import gc
import io
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import stat
import sys
import time
import traceback
import types

ROOT = "/fncall"            # the container's workdir; this script lives here
SHM = "/dev/shm/fncall"     # work root for pools without compiled programs
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
IPC_RMID = 0
EXIT_GRACE_S = 0.05           # after the call process exits, how long to wait for pipe EOF
DIE_WAIT_S = 5.0              # after a kill, how long until the container is declared unusable

_libc = ctypes.CDLL(None, use_errno=True)


class Fatal(Exception):
    """The container can no longer serve calls (the edge replaces it)."""


# ------------------------------------------------------------------------------------------
# shared helpers
# ------------------------------------------------------------------------------------------

def _prctl(option, value):
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _blob(data, out_dir, name, inline_max):
    if len(data) <= inline_max:
        return {"b64": base64.b64encode(data).decode()}
    path = "%s/%s" % (out_dir, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
    return {"path": path, "size": len(data)}


def _safe_rel(rel):
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError("bad relative path %r" % rel)
    return rel


# ------------------------------------------------------------------------------------------
# Z: the zygote
# ------------------------------------------------------------------------------------------

def zygote_main(sock, manager_pid, preload, env):
    """Fork one call process per request and report how it ended.

    Synchronous on purpose: the manager sends the next request to a zygote only after it
    reported the previous one done, so a blocking wait4 needs no signal handling and costs no
    extra wake-ups. Every process of a call descends from its zygote (the child subreaper, so
    orphans come back here): "no children left" means "nothing of the call is left". The exit
    report says whether anything is; if so, the manager kills the call uid and the zygote
    reports "empty" once it has reaped the last of them.
    """
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != manager_pid:
        os._exit(1)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for sig, how in ((signal.SIGPIPE, signal.SIG_IGN), (signal.SIGXFSZ, signal.SIG_IGN),
                     (signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                     (signal.SIGCHLD, signal.SIG_DFL)):
        signal.signal(sig, how)   # what a warm call sees: CPython's defaults for a script
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)          # never the manager's result channel
    os.close(null)
    os.environ.update(env)    # e.g. OPENBLAS_NUM_THREADS=1 before numpy starts its threads
    loaded = []
    for name in preload:
        try:
            __import__(name)
            loaded.append(name)
        except Exception:
            pass
    gc.collect()
    gc.freeze()               # children share these pages instead of touching them in gc
    global _VM_SIZE
    _VM_SIZE = _vm_size() + (8 << 20)   # + slack for what a call process allocates to start
    sock.send(json.dumps({"ready": loaded}).encode())
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 5)
        if not msg:
            os._exit(0)
        try:
            pid = os.fork()
        except OSError as e:
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"error": "fork failed: %s" % e}).encode())
            continue
        if pid == 0:
            sock.close()
            call_main(int(msg), fds)       # never returns
        for f in fds:
            os.close(f)
        _, status, ru = os.wait4(pid, 0)
        children = False
        while True:           # reap what already died; are there others?
            try:
                other, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if other == 0:
                children = True
                break
        sock.send(b'{"exit": %d, "status": %d, "cpu_s": %.6f, "max_rss_kb": %d, "minflt": %d, "alive": %s}' % (
            pid, status, ru.ru_utime + ru.ru_stime, ru.ru_maxrss, ru.ru_minflt, b"true" if children else b"false"))
        if children:
            while True:
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    break
            sock.send(b'{"empty": true}')


# ------------------------------------------------------------------------------------------
# C: one call process (forked from Z; still root until it drops to the call uid)
# ------------------------------------------------------------------------------------------

def call_main(step_index, fds):
    try:
        spec_fd, stdin_fd, out_w, err_w, status_w = fds
        spec = json.loads(os.pread(spec_fd, 64 << 20, 0))
        step = spec["steps"][step_index]
        warm = step["argv"] is None
        if not warm:           # a zygote has CPython's defaults (SIGPIPE, SIGXFSZ ignored), a program not
            for sig in (signal.SIGINT, signal.SIGXFSZ, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        if not step.get("stdin"):
            stdin_fd = os.open("/dev/null", os.O_RDONLY)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(status_w, 3)
        os.closerange(4, 1 << 20)
        os.set_inheritable(3, False)
        os.chdir(spec["cwd"])
        _set_limits(spec, step, warm)
        uid, gid = spec["uid"], spec["gid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        os.umask(0o077)
        env = spec["env"]
    except BaseException as e:
        try:
            os.write(2, ("fncall: could not start the call: %s\n" % e).encode())
        finally:
            os._exit(126)
    if warm:
        _run_python(spec, env)
    argv = step["argv"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, ("fncall: cannot run %s: %s\n" % (argv[0], e.strerror)).encode())
        os._exit(127)


def _set_limits(spec, step, warm):
    mem = step["memory_mb"] << 20
    if step["limit_address_space"]:
        base = 0
        if warm:   # the forked interpreter already maps the preloaded modules
            base = _VM_SIZE or _vm_size()
        else:
            base = 64 << 20   # loader, libc, libstdc++
        _lower(resource.RLIMIT_AS, base + mem)
    # a backstop for CPU burnt by many threads; SIGXCPU at the soft limit is reported as a timeout
    cpu = int(step["timeout_s"]) + 1
    _lower(resource.RLIMIT_CPU, cpu, hard=cpu + 2)
    _lower(resource.RLIMIT_NPROC, spec["max_processes"])
    _lower(resource.RLIMIT_FSIZE, spec["max_file_mb"] << 20)
    _lower(resource.RLIMIT_NOFILE, 1024)
    _lower(resource.RLIMIT_CORE, 0)
    _lower(resource.RLIMIT_STACK, min(mem, 256 << 20), soft_only=True)


_VM_SIZE = 0     # a zygote's address space size, measured once before it forks calls


def _vm_size():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _lower(which, value, soft_only=False, hard=None):
    _, old_hard = resource.getrlimit(which)
    if old_hard != resource.RLIM_INFINITY:
        value = min(value, old_hard)
        hard = min(hard, old_hard) if hard is not None else None
    new_hard = old_hard if soft_only else (hard if hard is not None else value)
    resource.setrlimit(which, (value, new_hard))


def _run_python(spec, env):
    os.environ.clear()
    os.environ.update(env)
    src_path = os.path.join(spec["cwd"], spec["source"])
    sys.argv = [spec["source"]] + list(spec["args"])
    sys.path.insert(0, spec["cwd"])
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="surrogateescape")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="surrogateescape")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8", errors="backslashreplace",
        line_buffering=True)
    code = 0
    try:
        with open(src_path, "rb") as f:
            source = f.read()
        compiled = compile(source, src_path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        _status(b"S")
        code = 1
    except MemoryError:
        _status(b"M")
        code = 1
    else:
        _status(b"C")
        main = types.ModuleType("__main__")
        main.__file__ = src_path
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        try:
            exec(compiled, main.__dict__)
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException as e:
            if isinstance(e, MemoryError):
                _status(b"M")
            try:
                tb = e.__traceback__.tb_next if e.__traceback__ else None
                sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
            except BaseException:
                pass
            code = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120
    os._exit(code)


def _exit_code(e):
    c = e.code
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    try:
        sys.stderr.write(str(c) + "\n")
    except BaseException:
        pass
    return 1


def _status(b):
    try:
        os.write(3, b)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------
# M: the manager
# ------------------------------------------------------------------------------------------

class Manager:
    def __init__(self, cfg):
        self.uid = cfg["uid"]
        self.gid = cfg["gid"]
        self.cfg = cfg
        self.zygotes = {}          # name -> (pid, socket, preloaded module names)
        self._leftovers = set()    # zygotes that still have processes of the current call
        self._names = None         # regex of module names that pick a bigger zygote
        self._blobs_left = False   # the last result left files in self.out
        self._null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self.tmp_dirs = []         # world-writable dirs to clean after every call
        self._loaded = set()
        root = ROOT
        if cfg.get("work_on_shm") and os.path.isdir("/dev/shm"):
            root = SHM
        self.work = root + "/w"
        self.out = root + "/out"
        self.cache = CompileCache(ROOT + "/cache", cfg.get("cache_entries", 256), cfg.get("cache_bytes", 256 << 20))

    # -- start ----------------------------------------------------------------------------
    def start(self):
        os.umask(0o022)
        if self.cfg.get("cpu") is not None:
            try:
                os.sched_setaffinity(0, {self.cfg["cpu"]})
            except OSError:
                pass
        for d, mode in ((ROOT, 0o711), (os.path.dirname(self.work), 0o711), (self.work, 0o711),
                        (self.out, 0o700)):
            os.makedirs(d, exist_ok=True)
            os.chmod(d, mode)
        for d in (self.work, self.out, self.cache.root):
            os.makedirs(d, exist_ok=True)
            for name in os.listdir(d):
                _remove(os.path.join(d, name))
        os.chmod(self.cache.root, 0o711)
        for d in TMP_DIRS:
            if os.path.isdir(d) and not os.path.islink(d):
                try:
                    os.chmod(d, 0o1777)
                except OSError:
                    pass
                self.tmp_dirs.append(d)
        for name, preload in self.cfg.get("zygotes", {"base": []}).items():
            self._start_zygote(name, preload)
        # every zygote also has what this script imported before forking it (json, re, ...)
        self._loaded = {m.split(".")[0] for m in sys.modules}
        base = set(self.zygotes["base"][2]) | self._loaded
        extra = sorted({m.split(".")[0] for _, _, mods in self.zygotes.values() for m in mods} - base)
        self._names = re.compile(r"\b(%s)\b" % "|".join(map(re.escape, extra))) if extra else None
        langs = [name for name, needs in self.cfg.get("probes", {}).items()
                 if all(shutil.which(b) for b in needs)]
        return {"ready": True, "languages": langs, "python": sys.version.split()[0], "uid": self.uid,
                "zygotes": {n: z[2] for n, z in self.zygotes.items()}, "work": self.work}

    def _start_zygote(self, name, preload):
        ms, zs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            ms.close()
            for _, sock, _ in self.zygotes.values():
                sock.close()
            try:
                zygote_main(zs, me, preload, self.cfg.get("zygote_env", {}))
            finally:
                os._exit(1)
        zs.close()
        ready = _zmsg(ms, timeout=120)
        if "ready" not in ready:
            raise Fatal("zygote %s did not start: %r" % (name, ready))
        self.zygotes[name] = (pid, ms, ready["ready"])

    def _zygote_for(self, step, code):
        """Warm Python code goes to the first zygote (in config order) that preloaded every
        module the code names, so it forks from the smallest process that has what it needs
        (fork and exit cost grows with the process size). Everything else goes to "base"."""
        base = self.zygotes["base"][1]
        if step["argv"] is None and self._names is not None:
            named = set(self._names.findall(code))
            if named:
                for _, sock, mods in self.zygotes.values():
                    if named <= set(mods) | self._loaded:
                        return sock
                return list(self.zygotes.values())[-1][1]
        return base

    # -- one call -------------------------------------------------------------------------
    def handle(self, req):
        t0 = time.monotonic()
        rid = int(req["id"])
        if self._blobs_left:                   # blobs of the previous call: the edge has read them
            for name in os.listdir(self.out):
                _remove(os.path.join(self.out, name))
            self._blobs_left = False
        cwd = "%s/%d" % (self.work, rid)
        result = {"id": rid, "steps": [], "files": {}, "clean": False, "error": None}
        spec_fd = stdin_fd = None
        try:
            try:
                self._prepare(req, cwd)
                env = {"HOME": cwd, "TMPDIR": "/tmp"}
                env.update(req["env"])
                spec = {"cwd": cwd, "uid": self.uid, "gid": self.gid, "source": req["source"],
                        "args": req.get("args", []), "env": env, "steps": req["steps"],
                        "max_processes": req["max_processes"], "max_file_mb": req["max_file_mb"]}
                spec_fd = _memfd(json.dumps(spec).encode())
                stdin = req.get("stdin")
                stdin_fd = _memfd(base64.b64decode(stdin)) if stdin is not None else os.dup(self._null)
            except (ValueError, OSError) as e:
                result["error"] = "could not prepare the call: %s" % e
                result["setup_failed"] = True
            else:
                result["setup_s"] = time.monotonic() - t0
                key, artifacts = req.get("cache_key"), req.get("artifacts", [])
                for i, step in enumerate(spec["steps"]):
                    if step["name"] == "compile" and key and self.cache.fetch(key, cwd):
                        result["steps"].append(_cached_step())
                        result["cache"] = "hit"
                        continue
                    zsock = self._zygote_for(step, req["code"])
                    res = self._run_step(zsock, spec_fd, stdin_fd, i, step,
                                         req["output_cap"], req["inline_max"], rid)
                    alive = res.pop("alive")
                    if alive:
                        self._leftovers.add(zsock)
                    result["steps"].append(res)
                    if step["name"] == "compile":
                        if res["exit_code"] != 0 or res["timed_out"] or res["output_limited"]:
                            break
                        # only what the compiler alone produced (no process of the call left)
                        if key and not alive and self.cache.store(key, cwd, artifacts):
                            result["cache"] = "stored"
        finally:
            for f in (spec_fd, stdin_fd):
                if f is not None:
                    os.close(f)
            t1 = time.monotonic()
            clean, files, err = self._cleanup(cwd, req.get("fetch", []), req["fetch_max"])
            result["clean"] = clean
            if err:
                result["error"] = (result["error"] + "; " if result["error"] else "") + err
            result["files"] = {rel: self._blob(data, "%d.f%d" % (rid, i), req["inline_max"])
                               for i, (rel, data) in enumerate(files.items())}
            result["cleanup_s"] = time.monotonic() - t1
            result["wall_s"] = time.monotonic() - t0
        return result

    def _blob(self, data, name, inline_max):
        if len(data) <= inline_max:
            return {"b64": base64.b64encode(data).decode()}
        self._blobs_left = True
        return _blob(data, self.out, name, inline_max)

    def _prepare(self, req, cwd):
        os.mkdir(cwd, 0o700)
        os.chown(cwd, self.uid, self.gid)
        files = [(rel, base64.b64decode(b64)) for rel, b64 in req.get("files", {}).items()]
        files.append((req["source"], req["code"].encode("utf-8", "surrogateescape")))
        for rel, data in files:
            _safe_rel(rel)
            path = cwd
            for part in rel.split("/")[:-1]:
                path = os.path.join(path, part)
                if not os.path.isdir(path):
                    os.mkdir(path, 0o700)
                    os.chown(path, self.uid, self.gid)
            path = os.path.join(cwd, rel)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                _write_all(fd, data)
                os.fchown(fd, self.uid, self.gid)
            finally:
                os.close(fd)

    def _run_step(self, zsock, spec_fd, stdin_fd, index, step, cap, inline_max, rid):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        t0 = time.monotonic()
        try:
            socket.send_fds(zsock, [str(index).encode()], [spec_fd, stdin_fd, out_w, err_w, st_w])
        finally:
            for f in (out_w, err_w, st_w):
                os.close(f)
        bufs = {out_r: bytearray(), err_r: bytearray()}
        totals = {out_r: 0, err_r: 0}
        status = bytearray()
        open_fds = {out_r, err_r, st_r}
        poller = select.poll()
        for f in open_fds:
            poller.register(f, select.POLLIN)
        poller.register(zsock.fileno(), select.POLLIN)
        deadline = t0 + step["timeout_s"]
        exited = None
        exit_t = None
        killed_t = None
        timed_out = limited = emptied = False
        try:
            while True:
                now = time.monotonic()
                if exited is not None and (not (open_fds - {st_r}) or now >= exit_t + EXIT_GRACE_S):
                    break
                if exited is None and killed_t is None and now >= deadline:
                    timed_out = True
                    killed_t = now
                    self._kill_all()
                if killed_t is not None and exited is None and now > killed_t + DIE_WAIT_S:
                    raise Fatal("the call's processes did not die after SIGKILL")
                if exited is not None:
                    wait = exit_t + EXIT_GRACE_S - now
                elif killed_t is None:
                    wait = deadline - now
                else:
                    wait = 0.05
                for fd, _ in poller.poll(max(0, int(wait * 1000) + 1)):
                    if fd == zsock.fileno():
                        msg = _zmsg(zsock)
                        if "error" in msg:
                            raise Fatal(msg["error"])
                        if "exit" in msg:
                            exited, exit_t = msg, time.monotonic()
                        elif msg.get("empty"):     # leftovers (of this or an earlier step) are gone
                            self._leftovers.discard(zsock)
                            emptied = True
                        continue
                    data = os.read(fd, 1 << 16)
                    if not data:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    if fd == st_r:
                        status += data[:16]
                        continue
                    totals[fd] += len(data)
                    room = cap - len(bufs[fd])
                    if room > 0:
                        bufs[fd] += data[:room]
                    if totals[fd] > cap and not limited:
                        limited = True
                        if exited is None and killed_t is None:
                            killed_t = time.monotonic()
                            self._kill_all()
            if st_r in open_fds:
                os.set_blocking(st_r, False)
                try:
                    status += os.read(st_r, 16)
                except BlockingIOError:
                    pass
        finally:
            for f in (out_r, err_r, st_r):
                os.close(f)
        st = exited["status"]
        code = os.WEXITSTATUS(st) if os.WIFEXITED(st) else None
        sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
        py = {b"C": "compiled", b"S": "syntax"}.get(bytes(status[:1]))
        if b"M" in status:
            py = "memory"
        return {"name": step["name"], "alive": exited["alive"] and not emptied, "minflt": exited["minflt"],
                "exit_code": code, "signal": sig, "timed_out": timed_out,
                "output_limited": limited, "wall_s": exit_t - t0, "cpu_s": exited["cpu_s"],
                "max_rss_kb": exited["max_rss_kb"], "python": py,
                "stdout": self._blob(bytes(bufs[out_r]), "%d.%d.out" % (rid, index), inline_max),
                "stderr": self._blob(bytes(bufs[err_r]), "%d.%d.err" % (rid, index), inline_max),
                "stdout_bytes": totals[out_r], "stderr_bytes": totals[err_r]}

    # -- cleanup --------------------------------------------------------------------------
    def _kill_all(self):
        """Send SIGKILL to every process of the call uid.

        One kill(-1, SIGKILL) sent with real and effective uid = the call uid reaches exactly
        the processes of that uid, atomically: each has SIGKILL pending afterwards and its
        forks fail, so none can appear later. The saved uid stays 0 to switch back. (While
        switched, a process of the call could signal M; that can only end this container.)
        Completion is reported by the zygotes ("empty": they reaped their last child).
        """
        os.setresuid(self.uid, self.uid, 0)
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.setresuid(0, 0, 0)

    def _wait_empty(self):
        deadline = time.monotonic() + DIE_WAIT_S
        for zsock in list(self._leftovers):
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Fatal("processes of the call survived SIGKILL")
                msg = _zmsg(zsock, timeout=left)
                if msg.get("empty"):
                    break
            self._leftovers.discard(zsock)

    def _cleanup(self, cwd, fetch, fetch_max):
        """Returns (clean, {rel: bytes} of fetched files, problem)."""
        if self._leftovers:
            self._kill_all()
            self._wait_empty()
            if _uid_processes(self.uid):     # cannot happen: every call process descends from a zygote
                raise Fatal("a process of the call uid outside the zygotes' trees")
        files = _read_files(cwd, fetch, fetch_max) if fetch else {}
        problems = []
        if _has_ipc(self.uid):
            os.setresuid(-1, self.uid, -1)     # IPC_RMID needs the owner (no CAP_SYS_ADMIN)
            try:
                _remove_ipc(self.uid)
            finally:
                os.setresuid(-1, 0, -1)
            if _has_ipc(self.uid):
                problems.append("SysV IPC objects of the call uid survived")
        for p in [cwd] + [os.path.join(d, n) for d in self.tmp_dirs
                          for n in _owned_entries(d, self.uid)]:
            try:
                _remove(p)
            except OSError as e:
                problems.append("could not remove %s: %s" % (p, e))
        if os.path.lexists(cwd):
            problems.append("work dir %s survived" % cwd)
        return not problems, files, "; ".join(problems) or None

    # -- main loop ------------------------------------------------------------------------
    def serve(self, inp, out):
        buf = bytearray()
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                data = os.read(inp, 1 << 20)
                if not data:
                    return
                buf += data
                continue
            line = bytes(buf[:nl])
            del buf[:nl + 1]
            if not line.strip():
                continue
            try:
                req = json.loads(line)
            except ValueError as e:
                _write_all(out, (json.dumps({"id": None, "error": "bad request line: %s" % e}) + "\n").encode())
                continue
            try:
                res = self.handle(req)
            except Fatal as e:
                _write_all(out, (json.dumps({"id": req.get("id"), "fatal": str(e)}) + "\n").encode())
                raise
            _write_all(out, (json.dumps(res) + "\n").encode())


class CompileCache:
    """Compiled artifacts by key (a hash of the caller's project, image, language, compiler argv,
    environment, code and files, made by the edge: fncall/service.py compile_cache_key), so the
    same program run on many inputs compiles once per container, and a project never gets
    another's artifacts. Entries are
    root-owned (0755): a call gets hard links it can execute but not modify. Least recently
    used entries go first beyond `max_entries` or `max_bytes`."""

    def __init__(self, root, max_entries, max_bytes):
        self.root = root
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries = {}          # key -> (size, [names]); dict order = recency

    def fetch(self, key, cwd):
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self.entries[key] = entry
        d = os.path.join(self.root, key)
        try:
            for name in entry[1]:
                os.link(os.path.join(d, name), os.path.join(cwd, name))
        except OSError:
            self._drop(key)
            return False
        return True

    def store(self, key, cwd, patterns):
        import fnmatch
        if not all(c in "0123456789abcdef" for c in key) or key in self.entries:
            return False
        try:
            names = sorted(n for n in os.listdir(cwd) if any(fnmatch.fnmatchcase(n, p) for p in patterns))
            if not names:
                return False
            tmp = os.path.join(self.root, ".tmp-" + key)
            _remove(tmp)
            os.mkdir(tmp, 0o711)
            size = 0
            for name in names:
                data = _read_beneath(cwd, name, self.max_bytes + 1)
                if len(data) > self.max_bytes:
                    raise ValueError("artifact too large")
                fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755)
                try:
                    _write_all(fd, data)
                finally:
                    os.close(fd)
                size += len(data)
            os.rename(tmp, os.path.join(self.root, key))
        except (OSError, ValueError):
            _remove(os.path.join(self.root, ".tmp-" + key))
            return False
        self.entries[key] = (size, names)
        while len(self.entries) > self.max_entries or sum(e[0] for e in self.entries.values()) > self.max_bytes:
            self._drop(next(iter(self.entries)))
        return True

    def _drop(self, key):
        self.entries.pop(key, None)
        _remove(os.path.join(self.root, key))


def _cached_step():
    return {"name": "compile", "cached": True, "exit_code": 0, "signal": None, "timed_out": False,
            "output_limited": False, "wall_s": 0.0, "cpu_s": 0.0, "max_rss_kb": 0, "minflt": 0,
            "python": None, "stdout": {"b64": ""}, "stderr": {"b64": ""}, "stdout_bytes": 0,
            "stderr_bytes": 0}


def _zmsg(sock, timeout=None):
    if timeout is not None:
        r, _, _ = select.select([sock], [], [], timeout)
        if not r:
            raise Fatal("zygote did not answer")
    data = sock.recv(4096)
    if not data:
        raise Fatal("zygote exited")
    return json.loads(data)


def _memfd(data):
    fd = os.memfd_create("fncall", os.MFD_CLOEXEC)
    try:
        _write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _uid_processes(uid):
    """Pids whose real, effective or saved uid is `uid` (zombies included)."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/status" % name, "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if str(uid).encode() in line.split()[1:4]:
                            found.append(int(name))
                        break
        except OSError:
            pass
    return found


def _owned_entries(d, uid):
    try:
        with os.scandir(d) as it:
            return [e.name for e in it if e.stat(follow_symlinks=False).st_uid == uid]
    except OSError:
        return []


def _remove(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _read_files(cwd, fetch, fetch_max):
    """Regular files below cwd, opened without following any symlink (the call made them)."""
    out = {}
    budget = fetch_max
    for rel in fetch:
        try:
            data = _read_beneath(cwd, _safe_rel(rel), budget + 1)
        except (OSError, ValueError):
            continue
        if len(data) > budget:
            break
        budget -= len(data)
        out[rel] = data
    return out


def _read_beneath(cwd, rel, limit):
    fd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        parts = rel.split("/")
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        try:
            if not stat.S_ISREG(os.fstat(ffd).st_mode):
                raise ValueError("not a regular file")
            chunks, size = [], 0
            while size < limit:
                data = os.read(ffd, min(1 << 20, limit - size))
                if not data:
                    break
                chunks.append(data)
                size += len(data)
            return b"".join(chunks)
        finally:
            os.close(ffd)
    finally:
        os.close(fd)


def _has_ipc(uid):
    for kind in ("shm", "sem", "msg"):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                head = f.readline().split()
                col = head.index("uid")
                if any(len(c) > col and c[col] == str(uid) for c in (ln.split() for ln in f)):
                    return True
        except (OSError, ValueError):
            pass
    return False


def _remove_ipc(uid):
    """Remove the SysV shared memory, semaphores and message queues this uid owns."""
    calls = {"shm": lambda i: _libc.shmctl(i, IPC_RMID, None),
             "sem": lambda i: _libc.semctl(i, 0, IPC_RMID),
             "msg": lambda i: _libc.msgctl(i, IPC_RMID, None)}
    for kind, rm in calls.items():
        try:
            with open("/proc/sysvipc/" + kind) as f:
                head = f.readline().split()
                id_col, uid_col = 1, head.index("uid")
                for line in f:
                    cols = line.split()
                    if len(cols) > uid_col and int(cols[uid_col]) == uid:
                        rm(int(cols[id_col]))
        except (OSError, ValueError):
            pass


def main():
    cfg = json.loads(sys.argv[1])
    inp = os.dup(0)
    out = os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)       # stray prints cannot corrupt the result channel
    os.close(null)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    m = Manager(cfg)
    try:
        hello = m.start()
    except Exception as e:
        _write_all(out, (json.dumps({"fatal": "start failed: %s" % e}) + "\n").encode())
        return 2
    _write_all(out, (json.dumps(hello) + "\n").encode())
    try:
        m.serve(inp, out)
    except Fatal as e:
        sys.stderr.write("fncall zygote: %s\n" % e)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
