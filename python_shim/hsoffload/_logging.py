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
        others = [h for h in logger.handlers if h is not self and not isinstance(h, ForwardInfo)]
        if logging.getLogger().handlers or others:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001  (a logging handler must never raise into the caller)
            self.handleError(record)


class ForwardInfo(logging.Handler):
    """Re-logs hsoffload's INFO records through a training framework's logger (Axolotl's, transformers'), whose
    handlers show INFO where the root logger's do not. WARNING and above are not forwarded: they reach the root
    logger's handlers (or `StderrUnlessConfigured`) as before, so nothing is printed twice."""

    def __init__(self, target: str) -> None:
        super().__init__(logging.INFO)
        self.target = logging.getLogger(target)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or not self.target.isEnabledFor(record.levelno):
            return
        if any(record.levelno >= h.level and h.filter(record) for h in logging.getLogger().handlers):
            return  # the root logger's handlers print it already (it propagates there)
        try:
            copy = logging.makeLogRecord(record.__dict__)
            copy.name = self.target.name
            self.target.handle(copy)
        except Exception:  # noqa: BLE001  (a logging handler must never raise into the caller)
            self.handleError(record)


def route_info_to(target: str) -> None:
    """Make hsoffload's INFO messages appear in `target`'s log output (idempotent; one target at a time)."""
    for h in [h for h in logger.handlers if isinstance(h, ForwardInfo)]:
        if h.target.name == target:
            return
        logger.removeHandler(h)
    logger.addHandler(ForwardInfo(target))
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


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


def was_logged(key: str) -> bool:
    """True once `log_once(key, ...)` has logged (until `forget_logged`)."""
    with _lock:
        return key in _logged


def forget_logged() -> None:
    """Let every "log once" message be logged again (tests)."""
    with _lock:
        _logged.clear()
