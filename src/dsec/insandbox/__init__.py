"""Everything that runs inside a sandbox or a guest, and nothing else.

Files here are copied or compiled into sandboxes; none of them is imported by the host:
- dsec-agent.c      the in-sandbox agent (container PID 1, VM guest service): exec, sessions,
                    files, streaming (docs/agent-protocol.md); built static by dsec.agent.build;
                    one translation unit that includes its parts from agent/ (agent/protocol.h
                    is generated from dsec/agent/protocol.py by dsec.agent.gen_header)
- fncall_zygote.py  the FnCall pool manager/zygote (stdlib only), copied into pool containers
- vm-init.sh        a microVM's initramfs /init (busybox sh): overlay of the layers, then the agent
- code_interpreter_server.py  E2B's code-interpreter protocol on port 49999 over Jupyter kernels
                    (stdlib + jupyter_client), installed in the `code-interpreter` image
- sf_jupyter_driver.py  SandboxFusion's run_jupyter over that server (stdlib), written into each
                    run_jupyter sandbox (apiserver/sf_jupyter.py)

Paths to them come from `source(name)`, the one place the host finds these files.
"""

from pathlib import Path

HERE = Path(__file__).parent


def source(name: str) -> Path:
    """Path of an in-sandbox file shipped with dsec (e.g. 'dsec-agent.c')."""
    p = HERE / name
    if not p.is_file():
        raise FileNotFoundError(f"dsec.insandbox has no {name!r}")
    return p
