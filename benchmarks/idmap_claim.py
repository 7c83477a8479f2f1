"""`python benchmarks/idmap_claim.py OLD_SRC NEW_SRC [LIVE]` (as root): one uid-range claim + release
(backends/container/idmap.py) with LIVE other claims in the registry, the two versions of the module
side by side in alternating blocks of 200; medians in ms. A private registry on tmpfs (/dev/shm), as /run is."""
import importlib.util, os, shutil, statistics, sys, tempfile, time
from pathlib import Path
OLD, NEW = sys.argv[1], sys.argv[2]
LIVE = int(sys.argv[3]) if len(sys.argv) > 3 else 3000


def load(src: str, name: str):
    spec = importlib.util.spec_from_file_location(name, f"{src}/dsec/backends/container/idmap.py")
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m


home = Path(tempfile.mkdtemp(prefix="dsec-idmap-bench-", dir="/dev/shm"))   # tmpfs, as /run/dsec/idranges
try:
    reg, owner = home / "reg", home / "owner"; owner.mkdir()
    mods = {"old": load(OLD, "idmap_old"), "new": load(NEW, "idmap_new")}
    res: dict[str, list[float]] = {"old": [], "new": []}
    for block in range(6):
        for name, m in mods.items():
            shutil.rmtree(reg, ignore_errors=True)
            ids = m.IdRanges(reg, first=1 << 29, slots=4096)
            for s in range(LIVE):           # live claims, owned by a directory that exists
                (reg / str(s)).write_text(str(owner))
            for _ in range(200):
                t = time.perf_counter(); base = ids.allocate(owner); ids.release(base, owner)
                res[name].append((time.perf_counter() - t) * 1000)
    print(f"claim+release with {LIVE} live claims: " + ", ".join(f"{k} p50 {statistics.median(v):.3f} ms" for k, v in res.items())
          + f" | load1 {os.getloadavg()[0]:.1f}")
finally:
    shutil.rmtree(home, ignore_errors=True)
