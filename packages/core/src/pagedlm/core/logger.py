"""The ``pagedlm`` logger, configured once on first use."""

from __future__ import annotations

import logging
import sys

from pagedlm.core import envs

_configured = False


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time, not the one seen at configuration
    (pytest's capture and some servers replace it; a stale stream may already be closed)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler assigns it in __init__/setStream
        pass


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("pagedlm")
        if not root.handlers:
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(envs.logging_level())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
