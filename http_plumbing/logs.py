"""How the gateway and the engine processes log: one handler on the root logger, as text or as JSON
lines, every record stamped with the id of the request it was logged for (request_context.py)."""

from __future__ import annotations

import logging
import sys
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

from http_plumbing.request_context import request_id

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (None outside a request) to every record the handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class TextFormatter(logging.Formatter):
    """``time level logger: message``, then ``request_id=…`` for a record logged within a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} request_id={rid}" if rid else line


def configure_logging(level: str = "info", log_format: LogFormat = "text") -> None:
    """Replaces the root logger's handlers with one on stderr in ``log_format``. uvicorn is then run with
    ``log_config=None``, so that its own lines go through this handler too."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter("{asctime}{levelname}{name}{message}{request_id}", style="{",
                                       rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})
                         if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # A line per proxied request or heartbeat from the HTTP clients costs real time and says nothing.
    logging.getLogger("httpx").setLevel(logging.WARNING)
