"""The package cache's parts without a server: the digest-checked store and its size bound,
index pages in and out, npm metadata, seeding (issue 25.4; served: tests/test_pkgcache.py)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from dsec.pkgcache.index import parse_simple, render_simple, rewrite_npm, sha512_of_integrity
from dsec.pkgcache.seed import seed_dir
from dsec.pkgcache.store import BlobStore, DigestMismatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pkgcache_peer import make_npm_tgz, make_wheel  # noqa: E402


def _put(store: BlobStore, data: bytes, digest: str | None = None, pinned: bool = False) -> str:
    tmp = store.tmp_file()
    tmp.write_bytes(data)
    digest = digest or hashlib.sha256(data).hexdigest()
    store.put_file("sha256", digest, tmp, pinned=pinned)
    return digest


def test_bytes_that_do_not_match_the_digest_are_never_stored(tmp_path):
    store = BlobStore(tmp_path / "c", 1 << 20)
    good = hashlib.sha256(b"good").hexdigest()
    with pytest.raises(DigestMismatch):
        _put(store, b"evil", good)
    assert store.get("sha256", good) is None and store.total_bytes() == 0
    assert list((tmp_path / "c" / "tmp").iterdir()) == []
    assert store.get("sha256", _put(store, b"good")).read_bytes() == b"good"
    assert store.get("sha256", "../" + good[3:]) is None      # not a digest: never a path


def test_the_size_bound_evicts_least_recently_used_and_keeps_seeded(tmp_path):
    store = BlobStore(tmp_path / "c", 3000)
    pinned = _put(store, b"p" * 1000, pinned=True)
    a = _put(store, b"a" * 1000)
    b = _put(store, b"b" * 900)
    store._q("UPDATE blobs SET used_at = used_at - 3600")       # an hour ago: a use counts again
    assert store.get("sha256", a) is not None                  # a used after b
    c = _put(store, b"c" * 800)                               # 3700 > 3000: b goes
    assert store.get("sha256", b) is None and not store.path("sha256", b).exists()
    assert all(store.get("sha256", d) is not None for d in (pinned, a, c))
    store.max_bytes = 500
    store.evict()
    assert store.get("sha256", pinned) is not None and store.total_bytes() == 1000
    # kept index answers: a tenth of the bound, oldest first, the newest always kept
    store.max_bytes = 1000
    for k in ("p1", "p2", "p3"):
        store.save_page(k, b"x" * 60)   # 100 bytes for pages: only the newest fits
    assert store.page("p1") is None and store.page("p2") is None and store.page("p3") is not None


def test_simple_pages_keep_only_hashed_files_and_point_them_at_the_cache():
    page = (b'<a href="../../files/x-1.0-py3-none-any.whl#sha256=' + b"a" * 64 + b'" data-requires-python="&gt;=3.8">x</a>'
            b'<a href="https://files.example/x-0.9.tar.gz">no hash</a>'
            b'<a href="../../files/x-0.8.tar.gz#md5=abc">md5 only</a>')
    files = parse_simple(page, "https://user:secret@idx.example/simple/x/")
    assert [f.filename for f in files] == ["x-1.0-py3-none-any.whl"]
    assert files[0].url == "https://user:secret@idx.example/files/x-1.0-py3-none-any.whl"
    assert files[0].requires_python == ">=3.8"
    out = render_simple("x", files, "http://10.88.0.1:10081").decode()
    assert f"http://10.88.0.1:10081/pypi/files/sha256/{'a' * 64}/x-1.0-py3-none-any.whl#sha256=" in out
    assert "secret" not in out and "idx.example" not in out and 'data-requires-python="&gt;=3.8"' in out


def test_npm_metadata_keeps_versions_with_a_sha512_at_the_cache():
    digest = hashlib.sha512(b"t").hexdigest()
    import base64
    integrity = "sha512-" + base64.b64encode(bytes.fromhex(digest)).decode()
    assert sha512_of_integrity(integrity) == digest and sha512_of_integrity("sha1-abc") is None
    doc = {"name": "p", "dist-tags": {"latest": "2.0.0", "old": "1.0.0"},
           "versions": {"1.0.0": {"dist": {"tarball": "https://r.example/p/-/p-1.0.0.tgz", "shasum": "x"}},
                        "2.0.0": {"dist": {"tarball": "https://r.example/p/-/p-2.0.0.tgz", "integrity": integrity}}}}
    out, learned = rewrite_npm(doc, "http://gw:1", "https://r.example/p")
    assert list(out["versions"]) == ["2.0.0"] and out["dist-tags"] == {"latest": "2.0.0"}
    assert out["versions"]["2.0.0"]["dist"]["tarball"] == f"http://gw:1/npm/-/sha512/{digest}/p-2.0.0.tgz"
    assert learned == [("sha512", digest, "https://r.example/p/-/p-2.0.0.tgz", "p-2.0.0.tgz")]


def test_seeding_pins_wheels_npm_tarballs_and_debs_and_skips_the_rest(tmp_path):
    src = tmp_path / "seeds"
    (src / "sub").mkdir(parents=True)
    w = make_wheel(src, "Seed_Me", "1.0", "v")
    t = make_npm_tgz(src / "sub", "pkg", "1.2.3", "v")
    (src / "x.deb").write_bytes(b"!<arch>\n")
    (src / "notes.txt").write_text("x")
    store = BlobStore(tmp_path / "c", 10)          # smaller than the seeds: pinned ones stay
    done = seed_dir(store, src)
    assert done["pypi"] == [w.name] and done["npm"] == ["pkg@1.2.3"] and done["apt"] == ["x.deb"]
    assert "notes.txt" in done["skipped"][0] and len(done["skipped"]) == 1
    [s] = store.seeded("pypi", "seed-me")
    assert s.digest == hashlib.sha256(w.read_bytes()).hexdigest() and store.get("sha256", s.digest) is not None
    [n] = store.seeded("npm", "pkg")
    assert json.loads(n.meta)["version"] == "1.2.3"
    assert store.get("sha512", hashlib.sha512(t.read_bytes()).hexdigest()) is not None


def test_the_cache_port_is_a_kernel_entry_only_for_untunnelled_egress(tmp_path):
    from dsec.backends.container.network import SandboxNetworks
    from dsec.config import Paths
    from dsec.security.netpolicy import PROTO_TUNNEL, Allow
    nets = SandboxNetworks(Paths(tmp_path), lambda sid: tmp_path)
    try:
        gw = Allow("10.88.0.1/32", 10081, 10081, 1)
        assert nets._cache_allows([Allow("0.0.0.0/0", 1, 65535, 3)]) == [gw]
        assert nets._cache_allows([Allow("pypi.org", 80, 443, 4)]) == [gw]
        assert nets._cache_allows([]) == []                                   # no egress: no route to it
        assert nets._cache_allows([Allow("10.0.0.1/32", 1, 65535, 1), Allow("p:1080", 0, 0, PROTO_TUNNEL)]) == []
        # 15 port rules + DNS fill the 16 ranges of 0.0.0.0/0: the cache entry is left out, never an error
        assert nets._cache_allows([Allow("0.0.0.0/0", p * 10, p * 10, 1) for p in range(1, 16)]) == []
        assert nets.sandbox_env()["PIP_INDEX_URL"] == "http://10.88.0.1:10081/pypi/simple/"
    finally:
        nets.close()
