"""Which offload scope is current: the per-thread stack of entered scopes and the process-wide `any_active` flag.

The one home of the state the rest of the package asks "is a scope active here?": the transformers patch (per call),
the SAC cache wrapper and the head rule of policy "all". `torch.compile` guards on the value of `any_active`, so code
that dynamo traces skips hsoffload's graph breaks while no scope is active anywhere.

Thread-safety: the stack is thread-local (scopes are per thread, like the engine's); `any_active` is written under
`_lock` and read without it (a plain bool read).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

_tls = threading.local()  # .stack: the scopes entered on this thread, innermost last
_lock = threading.Lock()  # guards _active_count and any_active
_active_count = 0
# Scopes entered and not yet exited, process-wide, > 0. Read by name (`current.any_active`) so dynamo guards on it.
any_active = False


def current_scope() -> Optional[Any]:
    """The innermost offload scope entered on this thread, or None."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


def entered_on_this_thread(scope: Any) -> bool:
    """True if `scope` is active on the calling thread (anywhere in its stack, not only innermost)."""
    return scope in getattr(_tls, "stack", ())


def push(scope: Any) -> None:
    """Record that `scope` was entered on this thread."""
    global _active_count, any_active
    _tls.__dict__.setdefault("stack", []).append(scope)
    with _lock:
        _active_count += 1
        any_active = True


def pop(scope: Any) -> None:
    """Record that `scope` was exited on this thread (no-op if it is not on this thread's stack)."""
    global _active_count, any_active
    stack = getattr(_tls, "stack", [])
    if scope not in stack:
        return
    stack.remove(scope)
    with _lock:
        _active_count -= 1
        any_active = _active_count > 0
