"""The package logger and its "log once" helper, shared by every module of the shim."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

logger = logging.getLogger("hsoffload")


class StderrUnlessConfigured(logging.Handler):
    """Prints hsoffload's warnings to stderr while the application has configured no logging.

    Python prints a library's warnings through its last-resort handler only when no handler exists anywhere on the
    logger's path; a library that attaches a `NullHandler` (the usual advice) therefore silences them. This handler
    takes the last resort's place for the `hsoffload` logger alone: it writes WARNING and above to stderr when
    neither the root logger nor the `hsoffload` logger has another handler, and stays quiet once the application
    configures logging (its handlers then receive the records by propagation, once).
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or any(h is not self for h in logger.handlers):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001  (a logging handler must never raise into the caller)
            self.handleError(record)


def install_default_handler() -> None:
    """Attaches `StderrUnlessConfigured` to the `hsoffload` logger once (idempotent)."""
    if not any(isinstance(h, StderrUnlessConfigured) for h in logger.handlers):
        logger.addHandler(StderrUnlessConfigured())

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
