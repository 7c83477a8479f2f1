"""Image-name lookups the apiserver makes per create (D42), side by side in one run on the same
images.db: a fresh SQLite connection per lookup (ImageService's default, and what the server
did before D42) vs the server's kept per-thread reader (keep_reader=True).

    .venv/bin/python benchmarks/image_lookup.py [DSEC_HOME] [IMAGE] [N]
"""
import sys
import time
from pathlib import Path

from dsec.config import Paths
from dsec.images.service import ImageService


def per_lookup_ms(svc: ImageService, image: str, n: int) -> float:
    svc.get(image)
    t = time.perf_counter()
    for _ in range(n):
        svc.get(image)
    return (time.perf_counter() - t) / n * 1000


if __name__ == "__main__":
    home = Path(sys.argv[1] if len(sys.argv) > 1 else "/var/lib/dsec")
    image = sys.argv[2] if len(sys.argv) > 2 else "debian-python"
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    fresh = per_lookup_ms(ImageService(Paths(home)), image, n)
    kept = per_lookup_ms(ImageService(Paths(home), keep_reader=True), image, n)
    print(f"{n} lookups of {image!r}: fresh connection {fresh:.3f} ms, kept reader {kept:.3f} ms, "
          f"ratio {fresh / kept:.1f}x")
