"""Directories sent to the server as tar bodies (build contexts, OCI layouts)."""

from __future__ import annotations

import os
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from dsec.types import InvalidArgument


@contextmanager
def tar_dir(path: str | os.PathLike[str], field: str) -> Iterator[BinaryIO]:
    """An uncompressed tar of the directory's contents, in a temporary file (spooled in memory
    while small), rewound for reading. Owners are kept (numeric) as a build context's COPY needs."""
    root = Path(path)
    if not root.is_dir():
        raise InvalidArgument(f"{root} is not a directory", field=field,
                              fix="pass the directory (a build context holding a Dockerfile, or an OCI layout)")
    with tempfile.SpooledTemporaryFile(max_size=32 << 20) as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for entry in sorted(os.listdir(root)):
                tf.add(root / entry, arcname=entry)
        f.seek(0)
        yield f  # type: ignore[misc]
