"""FnCall backend: short stateless code (OJ tasks, reward checks, compile-and-run) run in
pre-created warm containers with a pre-forked interpreter, cleaned up after every call.

languages.py  the language table (data)
host.py       SandboxHost: the narrow interface to the node's edge that FnCall needs
pool.py       Worker (one warm container) and Pool (per image and language family)
service.py    FnCallService: the node's entry point, beside the edge (wired in dsec.embedded)
The in-container manager/zygote is dsec/insandbox/fncall_zygote.py, copied into each pool container.
"""
