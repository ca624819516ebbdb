"""Policy auto on the CPU (hsoffload's counting CPU allocator), in a plain loop: bit for bit plain checkpointing's
gradients whatever it chooses, and its measurements kept across a restart (auto_state_path)."""

from __future__ import annotations

import copy
import gc
import json
import logging
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import transformers

import hsoffload
from hsoffload.choose import sac_host_bytes
from hsoffload.offload import auto
from hsoffload.offload.auto import DeviceMemory
from hsoffload.targets import enable_checkpointing

SEQ = 256
MIB = 1 << 20


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, budget: Optional[int],
           **kwargs: Any) -> list[float]:
    losses = []
    for step in steps:
        ids = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(step))
        if budget is None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        else:
            with hsoffload.offload_hidden_states(model, policy="auto", device_budget=budget, min_offload_size=0,
                                                 offload_cpu_tensors=True, **kwargs):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _cloned(obj: Any) -> Any:
    """A state dict's copy made by torch's CPU allocator, as a resumed job's tensors are (deepcopy makes storages
    through c10's default allocator directly, which the meter does not see)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return type(obj)((k, _cloned(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_cloned(v) for v in obj]
    return copy.copy(obj)


@pytest.fixture(autouse=True)
def _meter() -> None:
    DeviceMemory(torch.device("cpu"))  # installed before any model: every run counts its weights alike


@pytest.mark.parametrize("budget_mib", [1, 12, 1024])
def test_cpu_budgets_bitwise(budget_mib: int) -> None:
    """Under anything (every layer offloads), in between, and generous (no layer checkpointed): the same losses and
    weights as plain checkpointing, and the decided steps' peaks under the budget when it fits."""
    ref, ref_opt = _model()
    ref_losses = _steps(ref, ref_opt, range(6), None)
    model, opt = _model()
    losses = _steps(model, opt, range(6), budget_mib * MIB)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    ctl = auto.controller(model)
    counts = ctl.decision.counts()
    if budget_mib == 1:
        assert counts["offload"] == 4 and not ctl.decision.fits
    elif budget_mib == 1024:
        assert counts["none"] == 4
    decided = [r for r in ctl.history if r.decided]
    assert decided and (not ctl.decision.fits or all(r.measured_peak_bytes <= budget_mib * MIB for r in decided
                                                      if r.measured_peak_bytes is not None))


def test_a_restarted_run_reuses_the_measurements_and_decides_alike(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Run A calibrates and decides, saving to auto_state_path; run B (a fresh model and optimizer loaded from A's
    state, as a resumed job) runs one lean step that checks the file (the file is a cache, not the truth), then
    decides from it with no further calibration step and makes A's choice; its training is bit for bit the same as
    an uninterrupted run's."""
    state = str(tmp_path / "auto-{rank}.json")
    budget = 12 * MIB
    ref, ref_opt = _model()
    ref_losses = _steps(ref, ref_opt, range(8), None)

    a, a_opt = _model()
    a_losses = _steps(a, a_opt, range(4), budget, auto_state_path=state)
    saved = json.loads((tmp_path / "auto-0.json").read_text())
    a_ctl = auto.controller(a)
    (key, bucket), = saved["buckets"].items()
    assert bucket["choices"] == [c.value for c in a_ctl.decision.choices] and key == f"1x{SEQ}q"
    a_choices, a_costs = a_ctl.decision.choices, a_ctl.costs
    resume = (_cloned(a.state_dict()), _cloned(a_opt.state_dict()))
    del a, a_opt, a_ctl
    gc.collect()

    b, b_opt = _model()
    b.load_state_dict(resume[0])
    b_opt.load_state_dict(resume[1])
    del resume
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        b_losses = _steps(b, b_opt, range(4, 8), budget, auto_state_path=state)
    b_ctl = auto.controller(b)
    assert b_ctl.restored == str(tmp_path / "auto-0.json")
    assert not b_ctl.history[0].decided and b_ctl.history[1].decided, "the file's one checking step, then decided"
    assert b_ctl.costs == a_costs and b_ctl.decision.choices == a_choices
    assert any("read from" in r.getMessage() for r in caplog.records)
    assert a_losses + b_losses == ref_losses
    assert all(torch.equal(x, y) for x, y in zip(b.parameters(), ref.parameters()))


def test_a_file_for_another_model_is_not_reused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "auto.json"
    state.write_text(json.dumps({"version": auto.STATE_VERSION, "layers": ["other.0"], "kinds": [], "world": 1,
                                 "rank": 0, "device": "cpu"}))
    model, opt = _model()
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        _steps(model, opt, range(3), 12 * MIB, auto_state_path=str(state))
    ctl = auto.controller(model)
    assert ctl.restored is None and not ctl.history[0].decided
    assert any("not reused: it was saved for another layers, kinds" in r.getMessage() for r in caplog.records)
    assert json.loads(state.read_text())["layers"][0] == "model.layers.0"  # overwritten by this run's decision
    # A file of an older format (version 1: probes without the projections) is not reused either.
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "version": 1}))
    caplog.clear()
    model, opt = _model()
    with caplog.at_level(logging.INFO, logger="hsoffload"):
        _steps(model, opt, range(3), 12 * MIB, auto_state_path=str(state))
    assert auto.controller(model).restored is None
    assert any("not reused: it was saved for another version" in r.getMessage() for r in caplog.records)


def test_a_model_without_a_torch_optimizer_still_decides_beside_one_with() -> None:
    """Optimizer steps count per model: a second model updated by hand (no torch optimizer) treats every micro-batch
    as a step's first and decides after its calibration, while another model's optimizer steps."""
    a, a_opt = _model()
    b, _ = _model()
    for step in range(4):
        _steps(a, a_opt, range(step, step + 1), 1024 * MIB)
        ids = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(step))
        with hsoffload.offload_hidden_states(b, policy="auto", device_budget=1024 * MIB, min_offload_size=0,
                                             offload_cpu_tensors=True):
            b(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            for p in b.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
    assert auto.controller(a).optimizer_steps == 4 and auto.controller(b).optimizer_steps == 0
    assert auto.controller(b).decisions >= 1


def test_the_host_budget_bounds_what_sac_may_offload() -> None:
    """The room the decision gets for sac's projections on the host: max_host_bytes less the inputs every layer may
    offload (none left: no sac), and the decision within it; bit for bit plain checkpointing's losses either way."""
    ref, ref_opt = _model()
    ref_losses = _steps(ref, ref_opt, range(4), None)
    rows = {}
    try:
        for name, host in (("roomy", 1 << 30), ("inputs only", 4 * SEQ * 64 * 4)):
            model, opt = _model()
            losses = _steps(model, opt, range(4), 1 << 30, max_host_bytes=host)
            ctl = auto.controller(model)
            assert losses == ref_losses
            rows[name] = (ctl._host_room(ctl.costs), ctl.decision)
            # Whatever the timings chose: the sac layers' projections within the room the decision was made for.
            assert sac_host_bytes(ctl.costs, ctl.decision.choices) <= rows[name][0]
    finally:
        hsoffload.set_host_budget("auto")  # process-wide: the next tests get the default back
    assert rows["roomy"][0] == (1 << 30) - 4 * SEQ * 64 * 4
    assert rows["inputs only"][0] == 0 and rows["inputs only"][1].counts()["sac"] == 0


def test_a_probes_copy_time_is_its_fastest_round_trip() -> None:
    """The link's speed is what a copy can reach: one copy slowed by the host (its thread waiting for a core, another
    process's transfer) must not make the chooser see a slow link (a single slow sample once made sac look dearer
    than recomputing on a busy CI machine). A scripted clock: the first round trip 40 ms out and back, the next
    ones faster; each direction's fastest (1 ms out, 2 ms back), the slower of the two, is 2 ms."""
    ticks = iter([0.0, 0.040, 0.080,  # round trip 1: 40 ms out, 40 ms back
                  1.0, 1.001, 1.003,  # round trip 2: 1 ms out, 2 ms back
                  2.0, 2.005, 2.008])  # round trip 3: 5 ms out, 3 ms back
    x = torch.randn(16, 8)
    assert auto.copy_time_s(x, lambda: next(ticks)) == pytest.approx(0.002)
    ticks = iter([0.0, 0.040, 0.080])
    assert auto.copy_time_s(x, lambda: next(ticks), repeats=1) == pytest.approx(0.040)  # one sample: the slow one
