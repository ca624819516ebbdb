"""The package logger and its "log once" helper, shared by every module of the shim."""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("hsoffload")

_lock = threading.Lock()
_logged: set[str] = set()  # keys of messages already logged: "once" means once per process, by intent


def log_once(key: str, level: int, msg: str, *args: Any) -> None:
    """Log `msg` at `level` the first time `key` is seen in this process."""
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.log(level, msg, *args)


def forget_logged() -> None:
    """Let every "log once" message be logged again (tests)."""
    with _lock:
        _logged.clear()
