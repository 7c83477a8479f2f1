"""dsec: elastic sandboxes for training and evaluating AI agents."""

from typing import TYPE_CHECKING, Any

from dsec.sdk.client import Client, Created, ExecFailed, Files, Sandbox
from dsec.types import FnCallRequest, FnCallResult, FnCallStatus
from dsec.types import MicroVMArgs, SnapshotInfo, VMArgs
from dsec.types import (ContainerArgs, DsecError, ExecEvent, ExecInfo, ExecRequest, ExecResult, FileEntry,
                        NetworkPolicy, NetworkRule, SandboxInfo, SandboxState)

if TYPE_CHECKING:   # type checkers see the generated, typed blocking client
    from dsec.sdk.sync import SyncClient

__all__ = ["Client", "Created", "ExecFailed", "Files", "Sandbox", "ContainerArgs", "DsecError",
           "ExecEvent", "ExecInfo", "ExecRequest", "ExecResult", "FileEntry", "NetworkPolicy", "NetworkRule",
           "SandboxInfo", "SandboxState", "SyncClient", "MicroVMArgs", "VMArgs", "SnapshotInfo",
           "FnCallRequest", "FnCallResult", "FnCallStatus"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import dsec` must work even while sync.py is being regenerated
    # (python -m dsec.sdk._gen_sync imports dsec.sdk.client, hence this package).
    if name == "SyncClient":
        from dsec.sdk.sync import SyncClient
        return SyncClient
    raise AttributeError(name)
