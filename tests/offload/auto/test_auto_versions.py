"""Policy auto's probe (a decoder layer's extra forward at a calibration step) is seen by no output recorder, on
every transformers of the matrix (tests/offload/test_transformers_matrix.py runs this file under 4.57 too,
whose `check_model_inputs` wraps the layers' forwards for the model call): a router-logit loss and the hidden
states a model returns are plain checkpointing's, bit for bit, from step 0 (the probe's step) on."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

import hsoffload
from hsoffload.offload import auto
from hsoffload.offload.auto import DeviceMemory
from hsoffload.targets import enable_checkpointing

STEPS = 4


@pytest.fixture(autouse=True)
def _meter() -> None:
    DeviceMemory(torch.device("cpu"))


def _mixtral() -> torch.nn.Module:
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256, output_router_logits=True,
                                     router_aux_loss_coef=0.5)
    return _ready(cfg)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return _ready(cfg)


def _ready(cfg: Any) -> torch.nn.Module:
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    return model


def _run(make: Any, with_auto: bool, **call: Any) -> tuple[list[Any], list[torch.Tensor], Any]:
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = hsoffload.offload_hidden_states(model, policy="auto", device_budget=1 << 30, min_offload_size=0,
                                            offload_cpu_tensors=True) if with_auto else None
    outs = []
    for step in range(STEPS):
        ids = torch.randint(3, 256, (2, 64), generator=torch.Generator().manual_seed(step))
        if scope is not None:
            with scope:
                out = model(input_ids=ids, labels=ids, **call)
                out.loss.backward()
        else:
            out = model(input_ids=ids, labels=ids, **call)
            out.loss.backward()
        outs.append(out)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, [p.detach().clone() for p in model.parameters()], auto.controller(model)


def test_a_router_logit_loss_is_plain_checkpointings_from_the_probes_step_on() -> None:
    ref, ref_params, _ = _run(_mixtral, False)
    got, params, ctl = _run(_mixtral, True)
    assert ctl is not None and ctl.buckets and any(b.probes for b in ctl.buckets.values())
    for a, b in zip(got, ref):
        assert torch.equal(a.loss, b.loss) and torch.equal(a.aux_loss, b.aux_loss)
        assert len(a.router_logits) == len(b.router_logits)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_the_hidden_states_returned_are_plain_checkpointings_from_the_probes_step_on() -> None:
    ref, _, _ = _run(_llama, False, output_hidden_states=True)
    got, _, ctl = _run(_llama, True, output_hidden_states=True)
    assert ctl is not None and any(b.probes for b in ctl.buckets.values())
    for a, b in zip(got, ref):
        assert len(a.hidden_states) == len(b.hidden_states) == 4
        assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))
