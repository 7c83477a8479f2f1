"""CPU of every request (issue 29 item 3): server, its children and the SDK client, per operation.

Starts an isolated `dsec up` (dsec.bench.server), then, after a warm-up:
  1. rounds of (create busybox, run `true` twice, stop) through the blocking SDK, one at a time:
     CPU of the server process (utime+stime of /proc/PID/stat, every thread), of its reaped
     children (cutime+cstime: crun and helpers) and of this client process (getrusage), per round;
     beside it the same round with raw crun (`crun run -d`, 2x `crun exec true`, `crun delete -f`)
     on the same rootfs, its CPU from RUSAGE_CHILDREN;
  2. `exec true` round trips on one sandbox: p50/p99 wall, server and client CPU per exec, and raw
     `crun exec true` beside it;
  3. SandboxFusion `POST /run_code` print(1) from one httpx client: p50/p99 and server CPU per call.

    PYTHONPATH=src python benchmarks/request_cpu.py [--rounds 60] [--execs 300] [--run-code 200]
        [--env K=V ...] [--pythonpath DIR] [--profile DIR]

--env/--pythonpath go to the server process only (compare a library without installing it for the
whole venv); --profile records the server with py-spy during each phase (py-spy on PATH or
PY_SPY=path) and writes DIR/<phase>.txt (collapsed stacks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec.bench.core import RawCrun, _pct  # noqa: E402
from dsec.bench.server import BenchServer  # noqa: E402
from dsec.images.service import ImageService  # noqa: E402
from dsec.sdk.sync import SyncClient  # noqa: E402
from dsec.types import ContainerArgs  # noqa: E402
from procstat import TCK, cpu_s, cpu_ticks, processes  # noqa: E402

def proc_cpu(pid: int) -> tuple[float, float]:
    """(self, reaped children) CPU seconds of `pid`."""
    ut, st, cut, cst = cpu_ticks(pid)
    return (ut + st) / TCK, (cut + cst) / TCK


def descendants_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds of every live descendant of `pid` (daemons it keeps: lxcfs, proxies, agents)."""
    kids: dict[int, list[int]] = {}
    info: dict[int, tuple[str, float]] = {}
    for p, comm, ppid, ticks in processes():
        kids.setdefault(ppid, []).append(p)
        info[p] = (comm, ticks / TCK)
    out, todo = {}, list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out[p] = info[p]
        todo += kids.get(p, [])
    return out


def sandbox_cpu(sandbox_id: str) -> float:
    """CPU seconds of the live processes of a sandbox (its agent, mostly): by their cgroup."""
    total = 0.0
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and sandbox_id in (d / "cgroup").read_text():
                total += cpu_s(int(d.name))
        except OSError:
            continue
    return total


def me_cpu(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class Meter:
    """CPU deltas of the server, its children, this process and this process's children."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self) -> Meter:
        self.s0, self.c0 = proc_cpu(self.pid)
        self.d0 = descendants_cpu(self.pid)
        self.m0, self.k0, self.t0 = me_cpu(), me_cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        s1, c1 = proc_cpu(self.pid)
        d1 = descendants_cpu(self.pid)
        # live across the whole window: what long-lived helpers (and a kept sandbox's agent) spent
        self.live: dict[str, float] = {}
        for p, (comm, cpu) in d1.items():
            if p in self.d0 and cpu > self.d0[p][1]:
                self.live[comm] = self.live.get(comm, 0.0) + cpu - self.d0[p][1]
        self.server, self.children = s1 - self.s0, c1 - self.c0
        self.client = me_cpu() - self.m0
        self.kids = me_cpu(resource.RUSAGE_CHILDREN) - self.k0
        self.wall = time.perf_counter() - self.t0


class Profiler:
    def __init__(self, pid: int, out: Path | None):
        self.pid, self.out, self.proc = pid, out, None
        self.exe = os.environ.get("PY_SPY") or shutil.which("py-spy")

    def start(self, phase: str) -> None:
        if not self.out or not self.exe:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([self.exe, "record", "-p", str(self.pid), "-r", "1000", "-f", "raw",
                                      "--nonblocking", "-o", str(self.out / f"{phase}.txt")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)   # py-spy attaches

    def stop(self) -> None:
        if self.proc:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)
            self.proc = None


def per(x: float, n: int) -> float:
    return round(x / n * 1000, 2)


def live(m: Meter, n: int) -> dict[str, float]:
    return {k: per(v, n) for k, v in sorted(m.live.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--execs", type=int, default=300)
    ap.add_argument("--run-code", type=int, default=200)
    ap.add_argument("--env", action="append", default=[], help="K=V for the server process")
    ap.add_argument("--pythonpath", default="", help="prepended to the server's PYTHONPATH")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--label", default="")
    a = ap.parse_args()

    srv = BenchServer("dsec-bench-cpu-")
    env = dict(kv.split("=", 1) for kv in a.env)
    if a.pythonpath:
        env["PYTHONPATH"] = a.pythonpath + os.pathsep + os.environ.get("PYTHONPATH", "")
    srv.env.update(env)
    images = ["busybox"] + (["fncall-python"] if a.run_code else [])
    srv.prepare(images)
    rootfs = ImageService(srv.paths).mount_image("busybox")
    raw = RawCrun(rootfs[0])
    out: dict = {"label": a.label, "rounds": a.rounds, "env": env}
    try:
        srv.start()
        pid = srv.proc.pid
        prof = Profiler(pid, a.profile)
        args = ContainerArgs(image="busybox", cpu_cores=1, memory_mb=256)
        with SyncClient(srv.url, srv.key) as c:
            for _ in range(5):      # warm-up: imports, pools, caches
                sb = c.create_container(args)
                sb.run("true")
                sb.stop()
            # 1. create + 2 commands + stop
            prof.start("round")
            with Meter(pid) as m:
                for _ in range(a.rounds):
                    sb = c.create_container(args)
                    sb.run("true")
                    sb.run("true")
                    sb.stop()
            prof.stop()
            out["round"] = {"server_ms": per(m.server, a.rounds), "children_ms": per(m.children, a.rounds),
                            "client_ms": per(m.client, a.rounds), "wall_ms": per(m.wall, a.rounds),
                            "live_descendants_ms": live(m, a.rounds)}
            with Meter(pid) as m:
                for i in range(a.rounds):
                    raw.run(f"r{i}")
                    raw.exec_true(f"r{i}")
                    raw.exec_true(f"r{i}")
                    subprocess.run(["crun", "--root", str(raw.root / "state"), "delete", "-f", f"r{i}"], check=True)
                    raw.ids.remove(f"r{i}")
            out["round_raw_crun"] = {"crun_cpu_ms": per(m.kids, a.rounds), "wall_ms": per(m.wall, a.rounds)}
            # 2. exec true round trip
            sb = c.create_container(args)
            for _ in range(20):
                sb.run("true")
            lat = []
            prof.start("exec")
            sb0 = sandbox_cpu(sb.id)
            with Meter(pid) as m:
                for _ in range(a.execs):
                    t0 = time.perf_counter()
                    sb.run("true")
                    lat.append((time.perf_counter() - t0) * 1000)
            sb1 = sandbox_cpu(sb.id)
            prof.stop()
            sb.stop()
            out["exec"] = {"p50_ms": round(_pct(lat, 50), 2), "p99_ms": round(_pct(lat, 99), 2),
                           "server_ms": per(m.server, a.execs), "children_ms": per(m.children, a.execs),
                           "client_ms": per(m.client, a.execs), "live_descendants_ms": live(m, a.execs),
                           "in_sandbox_ms": per(sb1 - sb0, a.execs)}
            raw.run("e0")
            raw_lat = []
            with Meter(pid) as m:
                for _ in range(100):
                    t0 = time.perf_counter()
                    raw.exec_true("e0")
                    raw_lat.append((time.perf_counter() - t0) * 1000)
            out["exec_raw_crun"] = {"p50_ms": round(_pct(raw_lat, 50), 2), "crun_cpu_ms": per(m.kids, 100)}
        # 3. SandboxFusion /run_code print(1), one client
        if a.run_code:
            with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.key}"}, timeout=60) as h:
                body = {"code": "print(1)", "language": "python"}
                for _ in range(20):
                    r = h.post("/run_code", json=body)
                    assert r.json()["status"] == "Success", r.text
                lat = []
                prof.start("run_code")
                with Meter(pid) as m:
                    for _ in range(a.run_code):
                        t0 = time.perf_counter()
                        r = h.post("/run_code", json=body)
                        lat.append((time.perf_counter() - t0) * 1000)
                        assert r.status_code == 200
                prof.stop()
                out["run_code"] = {"p50_ms": round(_pct(lat, 50), 2), "p99_ms": round(_pct(lat, 99), 2),
                                   "server_ms": per(m.server, a.run_code),
                                   "children_ms": per(m.children, a.run_code), "client_ms": per(m.client, a.run_code),
                                   "live_descendants_ms": live(m, a.run_code)}
    finally:
        raw.cleanup()
        srv.close()
    out["load"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
