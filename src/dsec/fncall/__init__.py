"""FnCall backend: short stateless code (OJ tasks, reward checks, compile-and-run) run in
pre-created warm containers with a pre-forked interpreter, cleaned up after every call.

languages.py  the language table (data)
(the in-container manager/zygote is dsec/insandbox/fncall_zygote.py, copied into each pool container)
pool.py       Worker (one warm container) and Pool (per image and language family)
service.py    FnCallService: the node's entry point, owned by the edge
"""
