"""ClassPatch on a module's attribute (ZeRO-3 loading patches DeepSpeed's and transformers' module functions) and
on an attribute this version of a library lacks (`missing_ok`)."""

from __future__ import annotations

import logging
import types

import pytest

from hsoffload.classpatch import PATCH_ATTR, ClassPatch


def _module() -> types.ModuleType:
    m = types.ModuleType("fake_lib")
    m.f = lambda x: x + 1
    return m


def _adds_ten(previous, patch):  # noqa: ANN001, ANN202
    def wrapper(x: int) -> int:
        return previous(x) + (10 if patch.active else 0)

    return wrapper


def test_a_module_attribute_is_wrapped_and_restored_exactly() -> None:
    m = _module()
    stock = m.f
    p = ClassPatch(lambda: m, "f", _adds_ten)
    assert p.install() and p.install()  # idempotent
    assert m.f(1) == 12 and getattr(m.f, PATCH_ATTR)
    assert p.remove()
    assert m.f is stock and m.f(1) == 2


def test_a_missing_attribute_stays_stock_with_missing_ok(caplog: pytest.LogCaptureFixture) -> None:
    m = _module()
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        assert ClassPatch(lambda: m, "g", _adds_ten, missing_ok=True).install() is False
    assert "fake_lib has no g" in caplog.text
    assert not hasattr(m, "g")
    with pytest.raises(AttributeError, match="fake_lib has no g to patch"):
        ClassPatch(lambda: m, "g", _adds_ten).install()
