#!/usr/bin/python3
"""Which packages to add to a `debootstrap --include=` list so that it configures.

debootstrap resolves dependencies itself: the first alternative of each, and never a virtual
package, so a closure that needs a virtual package (npm's node-has, pyzmq's
python3-cffi-backend-api-*) unpacks but fails to configure. This emulates that resolution with
the host's apt cache (Debian bookworm's own versions only: other origins such as nodesource are
left out) and prints, comma-separated, one provider per virtual package left unprovided, the
smallest, until none is; then how big the closure is. The built-in images' lists
(dsec/images/builtin.py) name what it prints.

Usage (needs python3-apt and `apt-get update` with bookworm in the sources):
    scripts/debootstrap-providers.py python3,git,nodejs,npm
"""

from __future__ import annotations

import sys

import apt_pkg

SUITE = "bookworm"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    apt_pkg.init()
    cache = apt_pkg.Cache(None)
    versions: dict[str, object] = {}

    def debian(v) -> bool:
        return any(pf.origin == "Debian" and pf.codename == SUITE for pf, _ in v.file_list)

    def version(name: str):
        if name not in versions:
            pkg = None
            for arch in ("amd64", "all"):
                try:
                    pkg = cache[name, arch]
                    break
                except KeyError:
                    continue
            found = [v for v in (pkg.version_list if pkg else []) if debian(v)]
            versions[name] = found[0] if found else None
        return versions[name]

    required = {p.name for p in cache.packages if p.architecture in ("amd64", "all")
                and (v := version(p.name)) is not None and v.priority == apt_pkg.PRI_REQUIRED}
    want, extra = argv[1].split(","), []
    while True:
        seen: set[str] = set()
        virtual: set[str] = set()
        todo = [*required, *want, *extra]
        while todo:
            name = todo.pop()
            if name in seen or name in virtual:
                continue
            v = version(name)
            if v is None:
                virtual.add(name)
                continue
            seen.add(name)
            for kind in ("Depends", "PreDepends"):
                for group in v.depends_list.get(kind, []):
                    todo.append(group[0].target_pkg.name.split(":")[0])     # the first alternative
        provided = {prov[0].split(":")[0] for name in seen for prov in version(name).provides_list}
        missing = sorted(virtual - provided)
        if not missing:
            break
        for name in missing:
            providers = sorted({p[2].parent_pkg.name for p in cache[name].provides_list if debian(p[2])}
                               if name in cache else [], key=lambda p: version(p).installed_size)
            if not providers:
                print(f"{name}: no provider in Debian {SUITE}", file=sys.stderr)
                return 1
            print(f"{name} -> {providers[0]}", file=sys.stderr)
            if providers[0] not in extra:
                extra.append(providers[0])
    print(",".join(extra))
    size = sum(version(n).installed_size for n in seen)
    print(f"{len(seen)} packages, {size / 2**20:.0f} MiB installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
