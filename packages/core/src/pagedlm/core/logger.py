"""The ``pagedlm`` logger, configured once on first use."""

from __future__ import annotations

import logging

from pagedlm.core import envs

_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("pagedlm")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(envs.logging_level())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
