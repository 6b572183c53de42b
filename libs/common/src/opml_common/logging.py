"""Structured logging: one JSON object per line (or plain text for people), set up once per process."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter


def configure_logging(service: str, *, level: str = "INFO", fmt: str = "json") -> None:
    """Route the root logger to stderr; JSON lines carry the service name and any ``extra`` fields."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            static_fields={"service": service},
        ))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aiokafka", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
