"""transformers' own training tests as a peer suite, and checkpoint functions that answer every attribute (issue 52,
item 6).

transformers 5.23's `test_training_gradient_checkpointing` replaces a layer's `_gradient_checkpointing_func` with a
`unittest.mock` object; a walk of it by "has an attribute" never ends (each attribute is a new mock) and the process
grew until the OOM killer ended it. The suites run in a child under an address-space cap (support.limited), so such a
regression fails here with a MemoryError instead.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import hsoffload
from hsoffload import targets
from support import hf_tiny
from support.limited import GIB, run_python

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "hf_peer_suite.py"
# A child that imports torch and transformers and trains a tiny model peaks near 0.9 GiB of address space here; a walk
# over a mock object passes 3 GiB within seconds.
CAP = 3 * GIB


def _run(command: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{command}.json"
    proc = run_python(SCRIPT, [command, str(out)], address_space=CAP, timeout=240)
    assert proc.returncode == 0, f"{SCRIPT.name} {command} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(not transformers.__version__.startswith("5.23."),
                    reason=f"the vendored upstream tests are transformers 5.23's; installed: {transformers.__version__}")
def test_transformers_own_training_tests_pass_with_a_scope_around_each(tmp_path: Path) -> None:
    results = _run("suite", tmp_path)
    families = {name.split(".")[-2] for name in results}
    assert len(families) >= 3, families
    assert len(results) == 4 * len(families), sorted(results)  # test_training and the 3 checkpointing scenarios
    for name, r in results.items():
        assert r["plain"] == "passed", f"{name} fails without hsoffload: {r['plain']}"
        assert r["scoped"] == r["plain"], f"{name} with a scope around it: {r['scoped']} (without: {r['plain']})"
        if "gradient_checkpointing" in name:  # engaged: the checkpointed layers' inputs went to the host and back
            assert r["offloaded"] > 0 and r["restored"] == r["offloaded"], (name, r)


@pytest.mark.slow
def test_a_mocked_checkpoint_function_in_a_scope_runs_bit_for_bit_in_bounded_memory(tmp_path: Path) -> None:
    r = _run("mock", tmp_path)
    assert r["bitwise"] == "equal", r["bitwise"]
    steps = len(r["offloaded"])
    assert r["mock_calls"] == [steps] * r["layers"], r  # the mock ran each layer's checkpoint once a step
    assert r["offloaded"] == [r["layers"]] * steps and r["restored"] == r["offloaded"], r
    assert r["mocks_left_in_place"], "the layers' own (mock) checkpoint functions were not put back after the calls"


class AnswersEverything:
    """Answers every attribute with a new object of its kind (as a mock or a proxy does), and stops a walk after a
    thousand steps so that a regression fails here, fast and in bounded memory."""

    walked = 0

    def __getattr__(self, name: str) -> "AnswersEverything":
        AnswersEverything.walked += 1
        if AnswersEverything.walked > 1000:
            raise AssertionError(f"an object was walked by attribute ({name!r}) without end")
        return AnswersEverything()

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def test_checkpoint_functions_are_unwrapped_only_through_hsoffloads_own_wrapper() -> None:
    AnswersEverything.walked = 0
    odd = AnswersEverything()
    assert targets.unwrap_marking(odd) is odd
    inner = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    wrapper = targets.MarkingWrapper(inner, inner)
    assert targets.unwrap_marking(wrapper) is inner
    layer = hf_tiny.tiny_layer()
    layer._gradient_checkpointing_func = odd
    assert targets.checkpoint_function(layer) == (odd, {})
    assert not targets.uses_reentrant(layer)
    assert AnswersEverything.walked < 1000

    # and a whole step of a layer whose checkpoint function is such an object, in a scope: marked, offloaded, equal
    reference = hf_tiny.tiny_layer()
    x = torch.randn(4, 8, requires_grad=True)
    reference(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    with hsoffload.offload_hidden_states(offload_cpu_tensors=True, min_offload_size=0) as scope:
        layer(x2).sum().backward()
    hsoffload.unpatch()
    assert torch.equal(x.grad, x2.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), layer.parameters()))
    assert scope.stats.offloaded_tensors == 1, scope.stats
    assert layer.__dict__["_gradient_checkpointing_func"] is odd
    assert AnswersEverything.walked < 1000
