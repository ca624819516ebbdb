"""The policy-auto benchmark's same-model comparison (hsoffload.tools.bench.policy_auto.as_config): a guest
configuration's step on auto's model changes the layers only for that step, and leaves the model where plain
checkpointing's step would (bit for bit), so the comparison's rounds measure the same training run."""

from __future__ import annotations

import pytest
import torch

import hsoffload
from hsoffload.offload import auto
from hsoffload.targets import LAYER_ATTR, unwrap_marking
from hsoffload.tools.bench.policy_auto import Field, Setup, as_config, compare, make_model, undecided

TINY = Setup(layers=2, hidden=32, intermediate=64, experts=2, moe_intermediate=16, heads=2, kv_heads=1, seq=16,
             vocab=64)


def _grads(config: str) -> list[torch.Tensor]:
    model, _ = make_model(TINY, torch.device("cpu"))
    ids = torch.randint(3, TINY.vocab, (1, TINY.seq), generator=torch.Generator().manual_seed(0))
    with as_config(model, config):
        if config == "checkpointing":
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with hsoffload.offload_hidden_states(model, min_offload_size=0):
                model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad for p in model.parameters()]


def test_as_config_changes_the_layers_for_the_step_only() -> None:
    model, _ = make_model(TINY, torch.device("cpu"))
    layers = list(model.model.layers)
    funcs = [layer.__dict__[LAYER_ATTR] for layer in layers]
    with as_config(model, "none"):
        assert not any(layer.gradient_checkpointing for layer in layers)
    assert all(layer.gradient_checkpointing for layer in layers)
    with as_config(model, "sac_all"):
        assert all(unwrap_marking(layer.__dict__[LAYER_ATTR]).keywords["context_fn"] is auto.SAC_CONTEXT
                   for layer in layers)
    assert all(layer.__dict__[LAYER_ATTR] is f for layer, f in zip(layers, funcs))
    with pytest.raises(RuntimeError, match="inside"), as_config(model, "none"):
        raise RuntimeError("inside")
    assert all(layer.gradient_checkpointing for layer in layers)


@pytest.mark.parametrize("config", ["none", "sac_all"])
def test_a_guest_step_is_plain_checkpointings_bit_for_bit(config: str) -> None:
    expected = _grads("checkpointing")
    got = _grads(config)
    assert all(g is not None for g in got) and len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


class _Scripted:
    """Stands in for a Runner in `compare`: each round's own step takes the next scripted time, the guest's 1.0;
    every step is written down in order."""

    config = "auto"

    def __init__(self, ratios: list[float]) -> None:
        self._ratios = iter(ratios)
        self.times: list[float] = []
        self.rounds: list[int] = []
        self.events: list[str] = []

    def step(self, round_index: int) -> None:
        self.times.append(next(self._ratios))
        self.rounds.append(round_index)
        self.events.append("own")

    def run(self, config: str) -> tuple[float, int]:
        self.events.append("guest")
        return 1.0, 0

    @property
    def first(self) -> list[str]:
        """Per round, which of the two steps ran first."""
        return self.events[::2]


def _field() -> Field:
    field = Field.__new__(Field)  # no device: only the round counter is used by with_guest
    field._round = 0
    return field


def test_compare_adds_rounds_only_where_the_goal_is_undecided() -> None:
    decided, straddling = _Scripted([0.9] * 200), _Scripted([1.0, 1.06] * 100)
    field = _field()
    pairs = compare(field, [(decided, "checkpointing"), (straddling, "checkpointing")], rounds=15, most=45)
    assert [len(p) for p in pairs] == [15, 45]  # 15, then 6 batches of 5
    assert not undecided(pairs[0]) and undecided(pairs[1])
    # every job's own rounds first: the added ones come after the decided job's
    assert straddling.rounds[15] > max(decided.rounds)
    # the order alternates by the field's round, across batches of odd sizes too
    assert abs(straddling.first.count("own") - straddling.first.count("guest")) <= 1


def test_compare_stops_at_the_deadline_with_what_it_has() -> None:
    runner = _Scripted([1.0, 1.06] * 100)
    assert compare(_field(), [(runner, "none")], rounds=30, most=90, deadline=0.0) == [[]]
    assert [len(p) for p in compare(_field(), [(runner, "none")], rounds=30, most=12)] == [12]


class _Host:
    """Stands in for the fixed configurations' Runner in `Field.pick`: each guest step is written down."""

    def __init__(self) -> None:
        self.config = "checkpointing"
        self.events: list[str] = []

    def run(self, config: str) -> tuple[float, int]:
        self.events.append(config)
        return 1.0, len(config)


def test_the_pick_runs_every_fixed_configuration_on_one_model() -> None:
    """Every fixed configuration steps on the host's model (none on a model of its own), each round once, with the
    other runners' own steps, in an order that changes from round to round."""
    import random

    host, auto_runner = _Host(), _Scripted([1.0] * 10)
    field = _field()
    field.runners, field._order = [host, auto_runner], random.Random(0)
    configs = ["checkpointing", "offload_all", "none"]
    samples = field.pick(host, configs, 6)
    assert {c: len(s) for c, s in samples.items()} == {c: 6 for c in configs}
    assert samples["none"][0] == (1.0, 4) and sorted(host.events) == sorted(configs * 6)
    assert auto_runner.rounds == list(range(6))  # its own step every round, never as the host
    orders = {tuple(host.events[3 * k:3 * k + 3]) for k in range(6)}
    assert len(orders) > 1, orders
    assert field.pick(host, configs, 6, deadline=0.0) == {c: [] for c in configs}
