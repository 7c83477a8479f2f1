"""Progress reporting for long image work (debootstrap, tar extraction, hashing).

A progress callback is `fn(message, fraction)`: `message` is a short human line, `fraction`
is 0..1 when the stage knows how far it is, else None. Everything reported is also logged
to the `dsec.images` logger, so callers that pass no callback still see it at INFO/DEBUG.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger("dsec.images")

Progress = Callable[[str, "float | None"], None]


def report(progress: Progress | None, message: str, fraction: float | None = None, *,
           level: int = logging.DEBUG) -> None:
    log.log(level, "%s%s", message, "" if fraction is None else f" ({fraction:.0%})")
    if progress is not None:
        try:
            progress(message, fraction)
        except Exception:  # a broken progress display must not break a build
            log.exception("progress callback failed")


@contextmanager
def rich_progress(description: str = "building image") -> Iterator[Progress]:
    """A Progress callback that drives a `rich` progress bar (for CLIs)."""
    from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

    with RichProgress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[msg]}"), transient=True) as bar:
        task = bar.add_task(description, total=None, msg="")

        def update(message: str, fraction: float | None) -> None:
            if fraction is None:
                bar.update(task, total=None, msg=message[-80:])
            else:
                bar.update(task, total=1.0, completed=fraction, msg=message[-80:])

        yield update
