"""transformers' own training tests and a mocked checkpoint function, run in a child process under a memory cap
(tests/offload/test_transformers_peer_suite.py launches this script through `support.limited`).

Two commands, each writing its result as JSON to the path given last:
  suite   transformers 5.23's `test_training*` (support/upstream/transformers_5_23_training.py) for several families,
          every test once as upstream runs it (before hsoffload patches anything) and once with an offload scope
          around it; per test: the outcome of each run and what the scope offloaded.
  mock    a tiny llama whose layers' `_gradient_checkpointing_func` is a `unittest.mock` object (as upstream's
          gradient-checkpointing test installs it) trained inside a scope, against a same-seed twin trained without
          either: whether every loss and gradient is equal bit for bit, and what was offloaded.

Issue 52, item 6: a walk of the checkpoint function by "has an attribute" never ends on a mock object, which answers
every attribute; the cap turns such a regression into a MemoryError instead of the machine's OOM killer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import unittest
import unittest.mock
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: make `support.*` importable as the suites import it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

import hsoffload
from support import hf_tiny
from support.upstream.transformers_5_23_training import ModelTesterMixin

logger = logging.getLogger("hsoffload.tests.peer_suite")

FAMILIES = ("llama", "qwen2", "mistral")
# upstream's checkpointing test names the model classes it compares; the base model is skipped by the tests themselves
HEADS = ("Model", "ForCausalLM", "ForSequenceClassification")
SCOPE_KWARGS: dict[str, Any] = {"offload_cpu_tensors": True, "min_offload_size": 0}  # data really moves on a CPU


class TinyTester:
    """What upstream's model testers give `ModelTesterMixin` (CausalLMModelTester's role, which the sdist lacks): a tiny
    config from hf_tiny's local configs and a seeded batch."""

    is_training = True
    batch_size = hf_tiny.BATCH
    seq_length = hf_tiny.SEQ

    def __init__(self, family: str) -> None:
        self.family = family

    def get_config(self) -> Any:
        return hf_tiny.tiny_config(self.family, layers=2)

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(3, hf_tiny.VOCAB, (self.batch_size, self.seq_length), generator=g)
        return self.get_config(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _test_class(family: str) -> type[unittest.TestCase]:
    prefix = hf_tiny.FAMILIES[family].removesuffix("Config")
    classes = tuple(getattr(transformers, prefix + head) for head in HEADS)

    class PeerTest(ModelTesterMixin, unittest.TestCase):
        all_model_classes = classes

        def setUp(self) -> None:
            self.model_tester = TinyTester(family)

    PeerTest.__name__ = PeerTest.__qualname__ = f"{prefix}PeerTest"
    return PeerTest


def _outcome(result: unittest.TestResult) -> str:
    if result.errors:
        return "error: " + result.errors[0][1].strip().splitlines()[-1]
    if result.failures:
        return "failure: " + result.failures[0][1].strip().splitlines()[-1]
    if result.skipped:
        return "skipped"
    return "passed" if result.wasSuccessful() and result.testsRun == 1 else f"not run ({result.testsRun})"


def run_suite() -> dict[str, Any]:
    loader = unittest.TestLoader()
    loader.testMethodPrefix = "test_training"
    tests = [t for family in FAMILIES for t in loader.loadTestsFromTestCase(_test_class(family))]
    out: dict[str, Any] = {}
    for test in tests:  # as upstream runs them: nothing of hsoffload patched yet
        result = unittest.TestResult()
        test.run(result)
        out[test.id()] = {"plain": _outcome(result)}
    assert not hsoffload.is_patched()
    for test in tests:  # a scope around each test, as a user's training loop would hold one
        result = unittest.TestResult()
        with hsoffload.offload_hidden_states(**SCOPE_KWARGS) as scope:
            test.run(result)
        stats = scope.stats
        out[test.id()].update(scoped=_outcome(result), offloaded=stats.offloaded_tensors,
                              restored=stats.restored_tensors)
    hsoffload.unpatch()
    return out


def run_mock() -> dict[str, Any]:
    model = hf_tiny.tiny_model("llama")
    reference = hf_tiny.twin(model)
    hf_tiny.enable_checkpointing(model, reentrant=False)
    hf_tiny.enable_checkpointing(reference, reentrant=False)
    data = hf_tiny.batches(3)
    expected = hf_tiny.train_steps(reference, data, offload=False)
    layers = [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]
    mocks = []
    with contextlib.ExitStack() as stack:
        for layer in layers:  # upstream's way: the instance attribute replaced by a MagicMock calling the real one
            real = layer._gradient_checkpointing_func
            mocks.append(stack.enter_context(unittest.mock.patch.object(layer, "_gradient_checkpointing_func",
                                                                        side_effect=real)))
        got = hf_tiny.train_steps(model, data, offload=True)
        still_mocks = all(layer.__dict__["_gradient_checkpointing_func"] is m for layer, m in zip(layers, mocks))
    try:
        hf_tiny.assert_bitwise_equal(got, expected)
        equal = "equal"
    except AssertionError as exc:
        equal = f"differs: {exc}"
    stats = got[2]
    hsoffload.unpatch()
    return {"bitwise": equal, "layers": len(layers), "mock_calls": [m.call_count for m in mocks],
            "offloaded": [s.offloaded_tensors for s in stats], "restored": [s.restored_tensors for s in stats],
            "mocks_left_in_place": still_mocks}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    command, out_path = argv
    result = {"suite": run_suite, "mock": run_mock}[command]()
    Path(out_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
