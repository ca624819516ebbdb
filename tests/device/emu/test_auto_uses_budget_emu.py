"""Policy "auto" uses the budget it is given (issue 53), on the emulated device: three families (a dense Llama, a
Qwen3-MoE whose first layers are dense (`mlp_only_layers`), an OLMo-2 no other auto test names), copies at a set
rate, budgets from just above the leanest step's peak to 1.6 times the peak without checkpointing.

Every figure is measured here on the device's own counter: the leanest step's peak (every layer offloaded, policy
hidden_states) and the peak without checkpointing are runs of their own, and each decision's first step is read
after its backward (forward and backward; the optimizer's step is in the budget check, not the prediction's). The
prediction is read before that step runs, with the controller's safety margin at 0 (asserted).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import pytest
import torch
import transformers

import hsemu
import hsoffload
from hsoffload.choose import Choice, predict
from hsoffload.offload import auto
from hsoffload.targets import enable_checkpointing

SEQ = 512
RATE = 100_000_000  # 100 MB/s each way: copies compete with compute


def _llama() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                                    tie_word_embeddings=False)


def _moe() -> transformers.PretrainedConfig:
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[0, 1],
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    cfg._experts_implementation = "eager"
    return cfg


def _olmo2() -> transformers.PretrainedConfig:
    return transformers.Olmo2Config(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=5,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                                    tie_word_embeddings=False)


FAMILIES: dict[str, tuple[Callable[[], transformers.PretrainedConfig], float]] = {
    # name: (config, the bound on the prediction's overshoot: MoE's routing varies per batch)
    "llama": (_llama, 0.05), "qwen3_moe": (_moe, 0.08), "olmo2": (_olmo2, 0.05)}


def _model(dev: torch.device, make: Callable[[], transformers.PretrainedConfig]) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation="eager").to(dev)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _ids(dev: torch.device, step: int) -> torch.Tensor:
    return torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(step)).to(dev)


def _step(model: torch.nn.Module, opt: Any, dev: torch.device, step: int, **scope: Any) -> tuple[list, int, int]:
    """One step: the gradients, the forward-and-backward peak and the whole step's peak (this test's reads)."""
    ids = _ids(dev, step)
    hsemu.synchronize()
    hsemu.reset_peak()
    if scope:
        with hsoffload.offload_hidden_states(model, min_offload_size=0, **scope):
            model(input_ids=ids, labels=ids).loss.backward()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    hsemu.synchronize()
    fwd_bwd = hsemu.stats()["peak_allocated_bytes"]
    grads = [p.grad.cpu() for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=True)
    hsemu.synchronize()
    return grads, fwd_bwd, hsemu.stats()["peak_allocated_bytes"]


def _peaks(dev: torch.device, make: Callable[[], transformers.PretrainedConfig]) -> tuple[int, int]:
    """The leanest step's and the no-checkpointing step's whole peaks, the optimizer's step included (second steps:
    AdamW's states are there in both)."""
    gc.collect()
    model, opt = _model(dev, make)
    lean = max(_step(model, opt, dev, s, policy="hidden_states")[2] for s in range(2))
    for layer in model.model.layers:
        layer.gradient_checkpointing = False
    none = [_step(model, opt, dev, s)[2] for s in range(2)][-1]
    del model, opt
    gc.collect()
    return lean, none


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_auto_uses_its_budget(dev: torch.device, family: str, capsys: pytest.CaptureFixture[str]) -> None:
    make, over_bound = FAMILIES[family]
    with hsemu.copy_delay(0, 0, 0), hsemu.copy_rate(RATE, RATE, 0):
        lean, none = _peaks(dev, make)
        assert none > 1.4 * lean, "the model must leave room between the leanest step and no checkpointing"
        budgets = {"lean x1.03": int(lean * 1.03), "1/3": lean + (none - lean) // 3,
                   "2/3": lean + 2 * (none - lean) // 3, "none x1.02": int(none * 1.02), "none x1.6": int(none * 1.6)}
        # plain checkpointing's gradients, step by step (its own run: one model on the device at a time)
        ref_model, ref_opt = _model(dev, make)
        ref = [_step(ref_model, ref_opt, dev, s)[0] for s in range(3 + len(budgets))]
        del ref_model, ref_opt
        gc.collect()
        model, opt = _model(dev, make)
        rows = []
        step = 0
        for _ in range(3):  # calibration (every layer offloaded; ended when the next step starts), at the top budget
            got = _step(model, opt, dev, step, policy="auto", device_budget=budgets["none x1.6"])
            assert all(torch.equal(a, b) for a, b in zip(got[0], ref[step]))
            step += 1
        ctl = auto.controller(model)
        for name, budget in budgets.items():
            with hsoffload.offload_hidden_states(model, policy="auto", device_budget=budget, min_offload_size=0):
                pass  # a new budget decides again at once, before the step runs
            assert ctl.margin == 0, "the prediction is the model's own, without a safety margin"
            decision, costs, phases = ctl.decision, ctl.costs, ctl._lean_phases(ctl.bucket)
            predicted = decision.peak_bytes
            grads, fwd_bwd, whole = _step(model, opt, dev, step, policy="auto", device_budget=budget)
            assert all(torch.equal(a, b) for a, b in zip(grads, ref[step])), f"{name}: gradients differ"
            step += 1
            rows.append((name, budget, decision, predicted, fwd_bwd, costs, phases, whole))
    with capsys.disabled():
        print(f"\npolicy auto uses its budget, {family}: lean {lean / 2**20:.2f} MiB, no checkpointing "
              f"{none / 2**20:.2f} MiB")
        for name, budget, d, predicted, measured, _, _, whole in rows:
            print(f"  {name:10} {budget / 2**20:7.2f} MiB  {''.join(str(c)[0] for c in d.choices)}  predicted "
                  f"{predicted / 2**20:7.2f}  measured {measured / 2**20:7.2f} ({predicted / measured - 1:+.1%}), "
                  f"whole step {whole / 2**20:7.2f}")
    over = [(name, whole, budget) for name, budget, *_, whole in rows if whole > budget]
    assert not over, f"steps over their budget: {over}"
    for name, budget, d, predicted, measured, costs, phases, _ in rows:
        all_none = all(c is Choice.NONE for c in d.choices)
        bound = 0.02 if all_none else over_bound
        assert measured <= predicted, f"{name}: measured {measured} over the prediction {predicted}"
        assert predicted <= measured * (1 + bound), f"{name}: predicted {predicted} overshoots {measured} by more than {bound:.0%}"
        if name.startswith("none"):
            assert all_none, f"{name}: a layer is checkpointed at a budget above the no-checkpointing peak: {d.choices}"
        if name in ("1/3", "2/3"):
            assert len(set(d.choices)) > 1, f"{name}: the decision is not mixed: {d.choices}"
            # The room left is less than the cheapest one-layer upgrade (a layer moved to a faster choice)
            upgrades = []
            for k, c in enumerate(d.choices):
                for faster in (Choice.NONE, Choice.KEEP):
                    if faster is not c and costs[k].extra_s(faster) < costs[k].extra_s(c):
                        up = list(d.choices)
                        up[k] = faster
                        upgrades.append(predict(costs, up, phases, 0.0, ctl.sac_window, d.prefetch_depth)[0]
                                        - predicted)
            assert not upgrades or budget - predicted < min(upgrades), (name, budget - predicted, min(upgrades))
