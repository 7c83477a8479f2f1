"""The node's package cache (issue 25.4): content-addressed files of pip and npm indexes.

store.py keeps files by the digest an upstream index answer (or the operator's seed) gave for
them; index.py reads and rewrites PyPI simple pages and npm metadata; fetch.py asks upstream;
seed.py fills the store from local directories. Serving sandboxes is the container backend's
part (backends/container/pkgcache.py): it knows their policies and the node's resolver.
"""
