"""`ClassPatch`: one class attribute wrapped by hsoffload, with the same chaining and unpatch rules everywhere.

Every monkeypatch of the package (the decoder layer's `__call__`, `CheckpointWrapper.forward`,
`PreTrainedModel._initialize_missing_keys` and `_move_missing_keys_from_meta_to_device`, ZeRO-3 loading's
DeepSpeed and transformers functions) is one `ClassPatch`. The owner is a class or a module:

- `install()` wraps whatever the attribute is now (stock, or another library's patch) and calls it; it never copies
  the wrapped body. Idempotent: if our wrapper is already installed (on top, or under a patch installed later that
  chains through it) it is only made active again.
- `remove()` restores the exact previous attribute while ours is on top. When another patch sits on top, ours cannot
  be taken out of that chain: it becomes a pure pass-through (`active` False; a later `install()` turns it back on),
  a warning says so and `remove()` returns False.
- If someone else puts back the attribute we replaced, our wrapper is out of every chain and is forgotten.

Wrappers read `patch.active` on every call and forward untouched when it is False. Thread-safety: install/remove/
is_installed serialise on the patch's lock; `active` is a plain bool read by the wrappers without it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from ._logging import log_once

logger = logging.getLogger("hsoffload")

PATCH_ATTR = "_hsoffload_patched"  # set on every wrapper a ClassPatch installs
_MISSING = object()  # "the class had no attribute of its own"

def _qualname(owner: Any) -> str:
    """`module.Class` for a class, the module's name for a module (both can own a patched attribute)."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return str(getattr(owner, "__name__", owner))


MakeWrapper = Callable[[Callable[..., Any], "ClassPatch"], Callable[..., Any]]


class ClassPatch:
    """Wraps `owner().<name>`; `make(previous, patch)` builds the wrapper around the attribute it replaces.
    `missing_ok`: an owner without the attribute (another version of the library) is left stock, logged once, and
    `install()` returns False; otherwise that raises AttributeError."""

    def __init__(
        self,
        owner: Callable[[], Any],
        name: str,
        make: MakeWrapper,
        *,
        inherited_ok: bool = False,
        missing_hint: str = "",
        missing_ok: bool = False,
    ) -> None:
        self._owner = owner  # resolved lazily: the class's module may be imported late or not at all
        self.name = name
        self._make = make
        self._inherited_ok = inherited_ok  # wrap an inherited attribute (removed again by delattr)
        self._missing_hint = missing_hint
        self._missing_ok = missing_ok
        self._lock = threading.Lock()
        self.installed: Optional[Callable[..., Any]] = None  # our wrapper, wherever it sits in the chain
        self.previous: Any = _MISSING  # the class attribute our wrapper replaced
        self.active = False  # False: our wrapper only forwards

    def _forget_if_removed(self, cls: type) -> None:
        if self.installed is not None and cls.__dict__.get(self.name, _MISSING) is self.previous:
            logger.debug("hsoffload: %s.%s was restored by someone else; our patch is gone", _qualname(cls), self.name)
            self.installed, self.previous, self.active = None, _MISSING, False

    def install(self) -> bool:
        """Install (or re-activate) the wrapper. False if the owner class does not exist in this environment."""
        cls = self._owner()
        if cls is None:
            return False
        with self._lock:
            self._forget_if_removed(cls)
            if self.installed is not None:
                self.active = True
                return True
            previous = cls.__dict__.get(self.name, _MISSING)
            if previous is _MISSING and not (self._inherited_ok and hasattr(cls, self.name)):
                if self._missing_ok:
                    log_once(f"classpatch-missing:{_qualname(cls)}.{self.name}", logging.INFO,
                             "hsoffload: %s has no %s (another version): that part stays stock", _qualname(cls),
                             self.name)
                    return False
                raise AttributeError(
                    f"hsoffload: {_qualname(cls)} has no {self.name} to patch{self._missing_hint}"
                )
            wrapper = self._make(getattr(cls, self.name) if previous is _MISSING else previous, self)
            setattr(wrapper, PATCH_ATTR, True)
            self.installed, self.previous, self.active = wrapper, previous, True
            setattr(cls, self.name, wrapper)
            logger.debug("hsoffload: patched %s.%s (chaining through %r)", _qualname(cls), self.name, previous)
            return True

    def remove(self) -> bool:
        """Undo `install()`. True if the previous attribute was restored exactly (see the module docstring)."""
        cls = self._owner()
        if cls is None:
            return False
        with self._lock:
            self._forget_if_removed(cls)
            if self.installed is None:
                return False
            if cls.__dict__.get(self.name) is self.installed:
                if self.previous is _MISSING:
                    delattr(cls, self.name)
                else:
                    setattr(cls, self.name, self.previous)
                self.installed, self.previous, self.active = None, _MISSING, False
                return True
            self.active = False
            logger.warning(
                "hsoffload: %s.%s was patched again after hsoffload (%r); hsoffload's wrapper now only forwards "
                "inside that chain instead of being removed",
                _qualname(cls),
                self.name,
                cls.__dict__.get(self.name),
            )
            return False

    def is_installed(self) -> bool:
        """True if our wrapper is installed (on top or chained under a later patch) and active."""
        cls = self._owner()
        if cls is None:
            return False
        with self._lock:
            self._forget_if_removed(cls)
            return self.installed is not None and self.active

    def forget(self) -> None:
        """Drop the record of our wrapper without touching the class (for code that restored the class itself)."""
        with self._lock:
            self.installed, self.previous, self.active = None, _MISSING, False

    def original(self) -> Any:
        """The attribute below ours (what we wrap), or the class's own attribute when we are not installed."""
        if self.installed is not None and self.previous is not _MISSING:
            return self.previous
        cls = self._owner()
        return None if cls is None else cls.__dict__.get(self.name)
