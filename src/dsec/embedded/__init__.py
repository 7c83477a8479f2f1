"""Composition root of the single-machine deployment: wires the apiserver, one edge with its
backends, the FnCall service, IAM and the watcher in one process (`dsec up`). The only module
that names concrete backends."""
