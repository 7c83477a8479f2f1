"""Shared wire and domain types, by concern (errors, ids, sandboxes, execs, nodes, images,
fncall, builds); everything is importable from `dsec.types` itself.

Every layer (sdk, apiserver, edge, backends, images) imports this package; it imports
nothing of theirs. The HTTP API *is* these models: FastAPI derives the OpenAPI schema from
them and the SDK sends and parses them.
"""

from __future__ import annotations

from dsec.types.errors import (DsecError, InvalidArgument, NotFound, Unauthorized, Forbidden, Conflict,
                               CapacityExceeded, SandboxFailed, Unavailable, NodeUnreachable, PayloadTooLarge,
                               BadGateway, GatewayTimeout, InternalError, ERRORS_BY_CODE, ErrorDetail, ErrorBody)
from dsec.types.ids import (NODE_ID_RE, SANDBOX_ID_RE, make_sandbox_id, SNAPSHOT_ID_PATTERN, make_snapshot_id,
                            node_of_snapshot, node_of)
from dsec.types.sandboxes import (NAME_RE, MAX_TTL_S, ENV_KEY_RE, MAX_ENV_VARS, MAX_ENV_BYTES, Env, USER_RE, STORED,
                                  MAX_LABELS, MAX_LABEL_VALUE, LABEL_KEY_RE, ImageRef, SandboxUser, Labels, IdleTtl,
                                  Lifetime, IDEMPOTENCY_KEY_RE, SDK_KEY_PREFIX, IdempotencyKey, OutputCap,
                                  PORT_RANGE_RE, RULESET_NAME_RE, NetworkRule, NetworkPolicy, NetworkRuleSet, EgressProxy,
                                  ContainerArgs,
                                  MicroVMArgs, VMArgs, SandboxArgs, VM_BACKENDS, SandboxState, SandboxInfo,
                                  BulkSelector, BulkItem, BulkResult, SnapshotInfo, SnapshotImage, SnapshotList, SandboxList)
from dsec.types.execs import (MAX_EXEC_TIMEOUT_S, PtySize, ResizeRequest, ExecRequest, ExecResult, ExecInfo, ExecList, SignalRequest,
                              TimeoutRequest, ExecEvent, FileWrite, FileEntry, FsEvent, FileList)
from dsec.types.nodes import (NodeCapacity, NodeStatus, WarmPool, WarmPools)
from dsec.types.images import (LayerInfo, ImageInfo, ImageList, DEFAULT_SCRUB, PackDiffRequest)
from dsec.types.fncall import (FNCALL_MAX_TIMEOUT_S, FNCALL_MAX_BYTES, FNCALL_DEFAULT_IMAGE, FnCallRequest,
                               FnCallStatus, FnCallStep, FnCallResult, FnCallBatch, FnCallBatchItem)
from dsec.types.builds import (ImageConfig, ImageBuildResult, ImageProgress, ImagePullRequest)
from dsec.types.usage import (UsageSample, UsageList)
from dsec.types.secrets import (SecretCreate, SecretInfo, SecretList, EgressSecret, E2B_INLINE_MARK)
from dsec.types.forks import (MAX_FORKS, ForkRequest, ForkItem, ForkResult)
from dsec.types.events import (MAX_EVENT_ID, INFRASTRUCTURE_REASONS, USER_REASONS, END_REASONS, is_infrastructure, EventType,
                               SandboxEvent, EdgeEvents, EventList, WebhookCreate, WebhookInfo, WebhookList,
                               DeliveryInfo, DeliveryList, SandboxEnded, InfrastructureFailure, EndedByUser,
                               ended_error)

from dsec.types.volumes import (VolumeMount, VolumeCreate, VolumeEntry, VolumeEntryList, VolumeInfo, VolumeList)
from dsec.types.audit import (MAX_AUDIT_PAGE, AuditEntry, AuditList)

__all__ = [
    "VolumeMount", "VolumeCreate", "VolumeEntry", "VolumeEntryList", "VolumeInfo", "VolumeList",
    "MAX_AUDIT_PAGE", "AuditEntry", "AuditList",
    "MAX_EVENT_ID", "INFRASTRUCTURE_REASONS", "USER_REASONS", "END_REASONS", "is_infrastructure", "EventType", "SandboxEvent",
    "EdgeEvents", "EventList", "WebhookCreate", "WebhookInfo", "WebhookList", "DeliveryInfo", "DeliveryList",
    "SandboxEnded", "InfrastructureFailure", "EndedByUser", "ended_error",
    "SecretCreate", "SecretInfo", "SecretList", "EgressSecret", "E2B_INLINE_MARK",
    "UsageSample", "UsageList", "MAX_FORKS", "ForkRequest", "ForkItem", "ForkResult",
    "DsecError", "InvalidArgument", "NotFound", "Unauthorized", "Forbidden", "Conflict", "CapacityExceeded",
    "SandboxFailed", "Unavailable", "NodeUnreachable", "PayloadTooLarge", "BadGateway", "GatewayTimeout",
    "InternalError", "ERRORS_BY_CODE", "ErrorDetail", "ErrorBody", "NODE_ID_RE", "SANDBOX_ID_RE", "make_sandbox_id",
    "SNAPSHOT_ID_PATTERN", "make_snapshot_id", "node_of_snapshot", "node_of", "NAME_RE", "MAX_TTL_S", "ENV_KEY_RE",
    "MAX_ENV_VARS", "MAX_ENV_BYTES", "Env", "USER_RE", "STORED", "MAX_LABELS", "MAX_LABEL_VALUE", "LABEL_KEY_RE",
    "ImageRef", "SandboxUser", "Labels", "IdleTtl", "Lifetime", "IDEMPOTENCY_KEY_RE", "SDK_KEY_PREFIX",
    "IdempotencyKey", "OutputCap", "PORT_RANGE_RE", "RULESET_NAME_RE", "NetworkRule", "NetworkPolicy", "NetworkRuleSet", "EgressProxy",
    "ContainerArgs", "MicroVMArgs", "VMArgs", "SandboxArgs", "VM_BACKENDS", "SandboxState", "SandboxInfo",
    "BulkSelector", "BulkItem", "BulkResult", "SnapshotInfo", "SnapshotImage", "SnapshotList", "SandboxList", "MAX_EXEC_TIMEOUT_S",
    "PtySize", "ResizeRequest", "ExecRequest", "ExecResult", "ExecInfo", "ExecList", "SignalRequest", "TimeoutRequest", "ExecEvent", "FileWrite",
    "FileEntry", "FsEvent", "FileList", "NodeCapacity", "NodeStatus", "WarmPool", "WarmPools",
    "LayerInfo", "ImageInfo", "ImageList",
    "DEFAULT_SCRUB", "PackDiffRequest", "FNCALL_MAX_TIMEOUT_S", "FNCALL_MAX_BYTES", "FNCALL_DEFAULT_IMAGE",
    "FnCallRequest", "FnCallStatus", "FnCallStep", "FnCallResult", "FnCallBatch", "FnCallBatchItem", "ImageConfig",
    "ImageBuildResult", "ImageProgress", "ImagePullRequest",
]
