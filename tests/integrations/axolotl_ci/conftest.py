"""The Axolotl leg of CI (make test-axolotl): needs Axolotl installed; never collected by the main suite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: support.hf_tiny

axolotl = pytest.importorskip("axolotl", reason="the Axolotl leg needs Axolotl installed (make test-axolotl)")
