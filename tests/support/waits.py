"""Waiting for work on other threads (the spill tier's I/O threads) in tests: poll with a deadline, never sleep blind."""

from __future__ import annotations

import time
from typing import Any, Callable


def until(done: Callable[[], bool], what: Callable[[], Any], timeout: float = 30.0) -> None:
    """Waits until `done()`; fails after `timeout` seconds with `what()`, what was seen instead."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what()
        time.sleep(0.001)
