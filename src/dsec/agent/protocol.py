"""Wire format of the edge <-> in-sandbox agent protocol (docs/agent-protocol.md).

Pure encoding/decoding helpers; no I/O. Every frame is a 12-byte little-endian header
(u32 len, u8 type, u8 flags, u16 reserved, u32 chan) followed by `len` payload bytes.
Request payloads are fields: u8 tag, u32 len, bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable, Iterator

PROTOCOL_VERSION = 3     # 2: per-exec output credit (CREDIT, Tag.WINDOW); 3: PTY execs (Tag.PTY, RESIZE)
CREDIT_VERSION = 2
PTY_VERSION = 3
CREDIT_LET_GO = 0xFFFFFFFF   # CREDIT payload: the edge follows the chan no more
HEADER = struct.Struct("<IBBHI")
HEADER_SIZE = HEADER.size  # 12
MAX_PAYLOAD = (64 << 20) + 4096
MAX_DATA_CHUNK = 1 << 20  # DATA frames of FILE_READ are at most this big

EXIT_PAYLOAD = struct.Struct("<iiBBBBQQ")  # 28 bytes
LISTING_ENTRY = struct.Struct("<BIQqH")  # 23 bytes, then name
EXECS_ENTRY = struct.Struct("<IB")
EVENT_ENTRY = struct.Struct("<IH")  # then name
PONG_PAYLOAD = struct.Struct("<II")
ERROR_HEAD = struct.Struct("<i")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
PTY_SIZE = struct.Struct("<HH")  # Tag.PTY and RESIZE: columns, rows
FIELD_HEAD = struct.Struct("<BI")


class MsgType(IntEnum):
    # edge -> agent
    EXEC = 1
    STDIN = 2
    SIGNAL = 3
    RELEASE = 4
    ATTACH = 5
    FILE_READ = 6
    FILE_WRITE = 7
    LIST = 8
    PING = 9
    SESSION_CLOSE = 10
    LIST_EXECS = 11
    REMOVE = 12
    MKDIR = 13
    REFRESH = 14
    WATCH = 15
    UNWATCH = 16
    CREDIT = 17
    RESIZE = 18
    # agent -> edge
    STDOUT = 101
    STDERR = 102
    EXIT = 103
    ERROR = 104
    DATA = 105
    OK = 106
    LISTING = 107
    PONG = 108
    EXECS = 109
    EVENT = 110


class Tag(IntEnum):
    CMD = 1
    CWD = 2
    ENV = 3
    UID = 4
    GID = 5
    TIMEOUT_MS = 6
    CAP = 7
    SESSION = 8
    STDIN = 9
    PATH = 10
    DATA = 11
    MODE = 12
    MKDIRS = 13
    MAXLEN = 14
    KEEP_STDIN = 15
    TIME_NS = 16
    RECURSIVE = 17
    WINDOW = 18
    PTY = 19


KIND_NAMES = {0: "file", 1: "dir", 2: "symlink", 3: "other"}

FieldValue = bytes | bytearray | memoryview | str | int


class ProtocolError(Exception):
    """The peer sent something that does not follow the protocol."""


def encode_header(type_: int, chan: int, length: int) -> bytes:
    if length > MAX_PAYLOAD:
        raise ValueError(f"payload of {length} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(length, type_, 0, 0, chan)


def encode_frame(type_: int, chan: int, payload: bytes = b"") -> bytes:
    return encode_header(type_, chan, len(payload)) + payload


def decode_header(buf: bytes) -> tuple[int, int, int]:
    """-> (payload length, type, chan). Raises ProtocolError for oversize frames."""
    length, type_, _flags, _reserved, chan = HEADER.unpack(buf)
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_PAYLOAD}")
    return length, type_, chan


def encode_field(tag: int, value: FieldValue) -> bytes:
    """Strings are UTF-8; ints are u32 (the protocol's integer fields are all u32)."""
    if isinstance(value, bool) or isinstance(value, int):
        data = U32.pack(int(value))
    elif isinstance(value, str):
        data = value.encode()
    else:
        data = bytes(value)
    return FIELD_HEAD.pack(tag, len(data)) + data


def encode_fields(fields: Iterable[tuple[int, FieldValue]]) -> bytes:
    return b"".join(encode_field(tag, value) for tag, value in fields)


def _records(payload: bytes, head: struct.Struct, what: str) -> Iterator[tuple[tuple[int, ...], bytes]]:
    """Repeated `head` (whose last member is a length) + that many bytes: (head without the
    length, the bytes) of each record."""
    i = 0
    while i < len(payload):
        if len(payload) - i < head.size:
            raise ProtocolError(f"truncated {what} header")
        *values, n = head.unpack_from(payload, i)
        i += head.size
        if n > len(payload) - i:
            raise ProtocolError(f"truncated {what}")
        yield tuple(values), bytes(payload[i : i + n])
        i += n


def decode_fields(payload: bytes) -> list[tuple[int, bytes]]:
    return [(tag, data) for (tag,), data in _records(payload, FIELD_HEAD, "field")]


@dataclass(frozen=True)
class ExitInfo:
    exit_code: int  # -1 if signalled
    signal: int  # 0 if exited
    timed_out: bool
    truncated: bool
    session_ended: bool
    stdout_total: int
    stderr_total: int


def encode_exit(info: ExitInfo) -> bytes:
    return EXIT_PAYLOAD.pack(
        info.exit_code, info.signal, info.timed_out, info.truncated, info.session_ended, 0,
        info.stdout_total, info.stderr_total,
    )


def decode_exit(payload: bytes) -> ExitInfo:
    if len(payload) < EXIT_PAYLOAD.size:
        raise ProtocolError("short EXIT payload")
    code, sig, to, tr, se, _, out, err = EXIT_PAYLOAD.unpack_from(payload)
    return ExitInfo(code, sig, bool(to), bool(tr), bool(se), out, err)


def encode_error(errno_: int, message: str) -> bytes:
    return ERROR_HEAD.pack(errno_) + message.encode()


def decode_error(payload: bytes) -> tuple[int, str]:
    if len(payload) < ERROR_HEAD.size:
        raise ProtocolError("short ERROR payload")
    (err,) = ERROR_HEAD.unpack_from(payload)
    return err, bytes(payload[ERROR_HEAD.size :]).decode("utf-8", "replace")


def decode_pong(payload: bytes) -> tuple[int, int]:
    """-> (agent pid in its namespace, protocol version)."""
    if len(payload) < PONG_PAYLOAD.size:
        raise ProtocolError("short PONG payload")
    return PONG_PAYLOAD.unpack_from(payload)


def decode_pong_landlock(payload: bytes) -> int:
    """Landlock ABI the agent applies to every command (0: none; older agents send nothing)."""
    return U32.unpack_from(payload, PONG_PAYLOAD.size)[0] if len(payload) >= PONG_PAYLOAD.size + 4 else 0


def decode_ok_total(payload: bytes) -> int | None:
    return U64.unpack_from(payload)[0] if len(payload) >= U64.size else None


@dataclass(frozen=True)
class ListingEntry:
    name: bytes
    kind: int
    mode: int
    size: int
    mtime_ns: int


def decode_listing(payload: bytes) -> list[ListingEntry]:
    return [ListingEntry(name, kind, mode, size, mtime_ns)
            for (kind, mode, size, mtime_ns), name in _records(payload, LISTING_ENTRY, "LISTING entry")]


def decode_execs(payload: bytes) -> list[tuple[int, bool]]:
    if len(payload) % EXECS_ENTRY.size:
        raise ProtocolError("bad EXECS payload")
    return [(c, bool(f)) for c, f in EXECS_ENTRY.iter_unpack(payload)]


# inotify(7) bits an EVENT record carries
IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_Q_OVERFLOW, IN_ISDIR = 0x100, 0x200, 0x4000, 0x40000000


def decode_events(payload: bytes) -> list[tuple[int, bytes]]:
    """EVENT payload -> [(inotify mask, name relative to the watched directory)]."""
    return [(mask, name) for (mask,), name in _records(payload, EVENT_ENTRY, "EVENT record")]
