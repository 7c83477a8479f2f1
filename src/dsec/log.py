"""Structured logs: one JSON object per line, stdlib `logging` calls with `extra={...}` fields.

Modules log through plain `logging.getLogger("dsec.<module>")`; structlog renders the records
(and their extra fields) as JSON so edge and apiserver logs can be searched by sandbox id.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "INFO", stream=sys.stderr, json_lines: bool = True) -> None:
    pre_chain = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer])
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("uvicorn.access").setLevel("WARNING")
