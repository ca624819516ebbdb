"""When a backward that unpacked from a scope ends: the engine then gives back what it holds for unpacks that will
not come (`release_restores`): blocks prefetched ahead of their unpack and restores kept for handles that did not
unpack. A graph task ends early under `torch.autograd.grad` on some inputs or a partial backward; without this those
device bytes would stay until the graph is freed (or the scope exits).

Thread-safety: `GraphTaskWatch` is called from autograd's threads (unpack hooks, end-of-task callbacks); one lock
guards its set of open tasks.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch


class GraphTaskWatch:
    """Calls `release` once the outermost backward graph task that unpacked from the scope has ended.

    A reentrant checkpoint's recompute runs a backward of its own (a nested graph task) inside the outer one; its
    end must not release what the outer backward prefetched, so `release` waits until no watched task is open.
    """

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._open: set[int] = set()

    def note_unpack(self) -> None:
        """From an unpack hook: watch the running graph task (once per task)."""
        task = int(torch._C._current_graph_task_id())
        if task == -1:
            return  # not in a backward (a saved tensor read by hand)
        with self._lock:
            if task in self._open:
                return
            self._open.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._ended(task))

    def reset(self) -> None:
        """Forgets every watched task: a backward that raised never runs its end-of-task callbacks, so its id would
        stay open for good. The scope calls this at entry and exit (its earlier backwards are over by then; a scope
        used by several threads at once is not supported anyway: scopes are per thread)."""
        with self._lock:
            self._open.clear()

    def _ended(self, task: int) -> None:
        with self._lock:
            self._open.discard(task)
            if self._open:
                return
        self._release()
