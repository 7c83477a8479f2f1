"""dsec: elastic sandboxes for training and evaluating AI agents."""

from dsec.sdk.client import Client, Created, ExecFailed, Files, Sandbox
from dsec.types import FnCallRequest, FnCallResult, FnCallStatus
from dsec.types import MicroVMArgs, SnapshotInfo, VMArgs
from dsec.types import (ContainerArgs, DsecError, ExecEvent, ExecRequest, ExecResult, FileEntry,
                        NetworkPolicy, NetworkRule, SandboxInfo, SandboxState)

__all__ = ["Client", "Created", "ExecFailed", "Files", "Sandbox", "ContainerArgs", "DsecError",
           "ExecEvent", "ExecRequest", "ExecResult", "FileEntry", "NetworkPolicy", "NetworkRule",
           "SandboxInfo", "SandboxState", "SyncClient", "MicroVMArgs", "VMArgs", "SnapshotInfo",
           "FnCallRequest", "FnCallResult", "FnCallStatus"]


def __getattr__(name: str):
    if name == "SyncClient":   # imported lazily: it starts a background event loop thread on use
        from dsec.sdk.sync import SyncClient
        return SyncClient
    raise AttributeError(name)
