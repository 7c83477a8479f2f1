"""apt's parts of the package cache without a server (issue 25.4; served with the real apt:
tests/test_pkgcache_apt.py): which URLs are served how, what a Packages index may speak for,
what a Release names, seeding .debs and a mirror copy, and the spec's bind."""

from __future__ import annotations

import gzip
import hashlib
import lzma
from pathlib import Path

from dsec.pkgcache import apt
from dsec.pkgcache.seed import seed_dir
from dsec.pkgcache.store import BlobStore

H = "ab" * 32
M = "http://deb.example/debian"


def test_kind_serves_only_dists_files_and_pool_debs_of_http_mirrors():
    assert apt.kind(f"{M}/dists/bookworm/InRelease") == "meta"
    assert apt.kind(f"{M}/dists/bookworm/main/binary-amd64/by-hash/SHA256/{H}") == "by-hash"
    assert apt.kind(f"{M}/pool/main/h/hello/hello_2.10_amd64.deb") == "deb"
    for url in (f"{M}/pool/main/h/hello/hello_2.10.dsc", "https://deb.example/debian/dists/x/InRelease",
                f"{M}/dists/../pool/x.deb", f"{M}/pool/../../x.deb", f"{M}/pool//x.deb", f"{M}/x.deb",
                f"{M}/dists/x/InRelease?a=1", "http:///dists/x/InRelease"):
        assert apt.kind(url) is None, url
    assert apt.by_hash_digest(f"{M}/dists/b/main/binary-amd64/by-hash/SHA256/{H}") == H
    assert apt.is_packages(f"{M}/dists/b/main/binary-amd64/Packages.xz")
    assert apt.is_packages(f"{M}/dists/b/main/binary-amd64/by-hash/SHA256/{H}")
    assert not apt.is_packages(f"{M}/dists/b/main/i18n/by-hash/SHA256/{H}")
    assert apt.mirror_base(f"{M}/dists/b/InRelease") == M + "/"
    # apt may quote what a Filename writes plainly: one name in the store; quoting never hides a '..'
    assert apt.key(f"{M}/pool/main/g/g++/g%2b%2b_1_all.deb") == f"{M}/pool/main/g/g++/g++_1_all.deb"
    assert apt.kind(f"{M}/pool/%2e%2e/x.deb") is None


def _packages(*stanzas: tuple[str, str]) -> bytes:
    return "\n".join(f"Package: p\nFilename: {f}\nSHA256: {s}\nSize: 1\n" for f, s in stanzas).encode()


def test_a_packages_index_speaks_only_for_files_under_its_own_mirror(tmp_path):
    body = _packages(("pool/main/p/p/p_1_all.deb", H), ("../other/pool/p_1_all.deb", H),
                     ("/etc/p_1_all.deb", H), ("http://evil/p_1_all.deb", H), ("pool/main/p/p/p_1.dsc", H),
                     ("pool/main/q/q/q_1_all.deb", "not-a-digest"))
    for name, data in (("Packages", body), ("Packages.gz", gzip.compress(body)), ("Packages.xz", lzma.compress(body))):
        (tmp_path / name).write_bytes(data)
        assert list(apt.packages_entries(tmp_path / name, M + "/")) == [(f"{M}/pool/main/p/p/p_1_all.deb", H)]
    (tmp_path / "broken.xz").write_bytes(b"\xfd7zXZ\x00garbage")
    assert list(apt.packages_entries(tmp_path / "broken.xz", M + "/")) == []


def test_a_release_names_its_binary_packages_indexes(tmp_path):
    other = "cd" * 32
    (tmp_path / "InRelease").write_text(
        "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA256\n\nSuite: stable\nMD5Sum:\n"
        f" {'0' * 32} 1 main/binary-amd64/Packages\nSHA256:\n {H} 10 main/binary-amd64/Packages.xz\n"
        f" {other} 10 main/i18n/Translation-en\n {other} 10 main/binary-amd64/Release\n"
        "-----BEGIN PGP SIGNATURE-----\n\nxyz\n-----END PGP SIGNATURE-----\n")
    assert apt.release_packages(tmp_path / "InRelease") == [H]
    assert apt.index_key(M + "/", H) != apt.index_key("http://other/", H)


def test_apt_conf_points_http_at_the_cache_only():
    text = apt.apt_conf("10.88.0.1", 10081)
    assert 'Acquire::http::Proxy "http://10.88.0.1:10081/";' in text
    assert 'Acquire::https::Proxy "DIRECT";' in text


def test_seed_pins_debs_and_a_mirror_copy_as_that_mirrors_answers(tmp_path):
    store = BlobStore(tmp_path / "c", 1 << 20)
    src = tmp_path / "mirror"
    deb = b"!<arch>\nnot really a deb"
    sha = hashlib.sha256(deb).hexdigest()
    (src / "pool/main/p/p").mkdir(parents=True)
    (src / "pool/main/p/p/p_1_all.deb").write_bytes(deb)
    binary = src / "dists/stable/main/binary-amd64"
    binary.mkdir(parents=True)
    pk = _packages(("pool/main/p/p/p_1_all.deb", sha))
    (binary / "Packages").write_bytes(pk)
    pk_sha = hashlib.sha256(pk).hexdigest()
    (src / "dists/stable/InRelease").write_text(f"SHA256:\n {pk_sha} {len(pk)} main/binary-amd64/Packages\n")
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "q_1_all.deb").write_bytes(b"loose")
    out = seed_dir(store, src, "http://apt.example/debian")
    assert sorted(out["apt"]) == ["dists/stable/InRelease", "dists/stable/main/binary-amd64/Packages",
                                  "pool/main/p/p/p_1_all.deb"], out
    base = "http://apt.example/debian/"
    assert store.apt_lookup(base + "pool/main/p/p/p_1_all.deb")[:2] == (sha, "deb")
    assert store.apt_lookup(base + "dists/stable/InRelease")[1] == "meta"
    assert store.apt_lookup(apt.index_key(base, pk_sha))[1] == "index"
    assert store.get("sha256", sha).read_bytes() == deb
    # loose .debs without a mirror: kept by SHA256 (served when a Packages index names them)
    out = seed_dir(store, tmp_path / "loose")
    assert out["apt"] == ["q_1_all.deb"] and store.get("sha256", hashlib.sha256(b"loose").hexdigest())
    store.evict()
    assert store.get("sha256", sha) is not None   # pinned


def test_the_spec_binds_apt_conf_read_only_only_when_asked():
    from dsec.backends.container.spec import ContainerSpec, build_config
    base = dict(sandbox_id="s", lower_dirs=[Path("/l")], cpu_cores=1, memory_mb=256, pids_limit=64, uid=0, gid=0,
                workdir="/")
    dests = {m["destination"]: m for m in build_config(ContainerSpec(**base, apt_conf="/h/apt.conf"),
                                                       Path("/bin/true"), cgroup_v2=True)["mounts"]}
    m = dests["/etc/apt/apt.conf.d/90dsec-pkgcache"]
    assert m["source"] == "/h/apt.conf" and "ro" in m["options"]
    dests = {m["destination"] for m in build_config(ContainerSpec(**base), Path("/bin/true"), cgroup_v2=True)["mounts"]}
    assert "/etc/apt/apt.conf.d/90dsec-pkgcache" not in dests
