"""How `make test` spreads the suite over pytest-xdist workers (`-n auto --dist loadgroup`).

Each test is its own work unit, except the tests of a module that share one expensive module fixture (a 2-rank launch
that runs every case): those go whole to one worker, so that the launch happens once. xdist's own grouping
(`xdist_group` marks) suffixes the node id from the worker, which pytest 9.2 no longer lets a plugin do (the id lives
in `Item._id`; xdist 3.8.0 still writes `_nodeid`): measured, each such module launched once per worker that took one
of its tests. The scheduler below groups on the controller instead, through xdist's `pytest_xdist_make_scheduler`
hook, from the node ids alone.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling


class ModuleUnits(LoadScopeScheduling):
    """xdist's scope scheduling with one scope per test, except one scope per module named in `modules`.

    xdist sends the larger units first (its `--loadscope-reorder`, on by default), so the shared launches start at
    once and the single tests, collected slow-first, fill in around them.
    """

    modules: tuple[str, ...] = ()

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if module in self.modules else nodeid


def make_scheduler(config: Any, log: Any, modules: tuple[str, ...]) -> ModuleUnits | None:
    """The scheduler for `--dist loadgroup` runs, or None to leave any other `--dist` to xdist."""
    if config.getvalue("dist") != "loadgroup":
        return None
    scheduler = ModuleUnits(config, log)
    scheduler.modules = modules
    return scheduler
