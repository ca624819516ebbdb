"""The Trainer one-liner through real `Trainer.train()` / `SFTTrainer.train()` runs on a tiny in-memory dataset."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import transformers

from support import hf_tiny as H
import hsoffload
from hsoffload.offload.auto import controller as auto_controller
from hsoffload.targets import current_training_args
from hsoffload.integrations import HiddenStateOffloadMixin, enable_hidden_state_offload, with_hidden_state_offload

SCOPE = {"offload_cpu_tensors": True, "min_offload_size": 0}
KEYS = (
    "hsoffload/offloaded_gib",
    "hsoffload/restored_gib",
    "hsoffload/marked_tensors",
    "hsoffload/offloaded_tensors",
    "hsoffload/skipped_marked_tensors",
    "hsoffload/prefetch_hits",
    "hsoffload/wait_ms",
    "hsoffload/pool_gib",
)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 16) -> None:
        self.items = [{"input_ids": b["input_ids"][0], "labels": b["labels"][0]} for b in H.batches(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def training_args(tmp_path: Path, **overrides: Any) -> transformers.TrainingArguments:
    kwargs: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=2,
        learning_rate=1e-3,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=7,
    )
    kwargs.update(overrides)
    return transformers.TrainingArguments(**current_training_args(kwargs))


def _train_logs(trainer: Any) -> list[dict[str, float]]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("reentrant", [False, True])
def test_trainer_one_liner_bitwise_and_logged(tmp_path: Path, reentrant: bool) -> None:
    args = training_args(tmp_path, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = H.tiny_model("llama")
    reference = H.twin(model)

    trainer = enable_hidden_state_offload(
        transformers.Trainer(model=model, args=args, train_dataset=TokenDataset()), **SCOPE
    )
    trainer.train()
    plain = transformers.Trainer(model=reference, args=args, train_dataset=TokenDataset())
    plain.train()

    logs = _train_logs(trainer)
    assert len(logs) == 2  # max_steps / logging_steps
    forwards_per_log = args.logging_steps * args.gradient_accumulation_steps
    for entry in logs:
        assert all(key in entry for key in KEYS), entry
        assert entry["hsoffload/offloaded_tensors"] == forwards_per_log * H.LAYERS
        assert entry["hsoffload/marked_tensors"] == forwards_per_log * H.LAYERS
        assert entry["hsoffload/offloaded_gib"] > 0
        assert entry["hsoffload/restored_gib"] == entry["hsoffload/offloaded_gib"]
    assert trainer.hsoffload_scope.stats.offloaded_tensors == 2 * forwards_per_log * H.LAYERS
    summary = trainer.state.log_history[-1]
    assert "train_runtime" in summary and not any(k.startswith("hsoffload/") for k in summary), summary
    for a, b in zip(_train_logs(plain), logs):
        assert a["loss"] == b["loss"]
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name


@contextlib.contextmanager
def _transformers_warnings() -> Iterator[list[str]]:
    """The messages reaching the `transformers` logger's own handlers at WARNING (it does not propagate)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    collect = Collect(logging.WARNING)
    logging.getLogger("transformers").addHandler(collect)
    try:
        yield seen
    finally:
        logging.getLogger("transformers").removeHandler(collect)


def test_one_summary_line_in_transformers_log_output(tmp_path: Path) -> None:
    """transformers shows WARNING by default through its own handler (the `transformers` logger does not
    propagate): the once-per-run line goes there, at that level."""
    with _transformers_warnings() as seen:
        args = training_args(tmp_path)
        trainer = enable_hidden_state_offload(
            transformers.Trainer(model=H.tiny_model("llama"), args=args, train_dataset=TokenDataset()), **SCOPE
        )
        trainer.train()
    lines = [m for m in seen if m.startswith("hsoffload: offload on")]
    assert len(lines) == 1, seen
    assert f"{H.LAYERS} decoder layers" in lines[0] and "hsoffload/*" in lines[0]


def test_mixin_class_factory(tmp_path: Path) -> None:
    cls = with_hidden_state_offload(transformers.Trainer)
    assert with_hidden_state_offload(transformers.Trainer) is cls
    assert with_hidden_state_offload(cls) is cls
    assert issubclass(cls, HiddenStateOffloadMixin) and issubclass(cls, transformers.Trainer)
    trainer = cls(
        model=H.tiny_model("llama"),
        args=training_args(tmp_path, max_steps=2, logging_steps=1, gradient_accumulation_steps=1),
        train_dataset=TokenDataset(),
        hsoffload_config=hsoffload.OffloadConfig(**SCOPE),
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert [entry["hsoffload/offloaded_tensors"] for entry in logs] == [H.LAYERS, H.LAYERS]


def test_without_checkpointing_logs_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = training_args(tmp_path, max_steps=1, logging_steps=1, gradient_accumulation_steps=1, gradient_checkpointing=False)
    trainer = enable_hidden_state_offload(
        transformers.Trainer(model=H.tiny_model("llama"), args=args, train_dataset=TokenDataset()), **SCOPE
    )
    with caplog.at_level(logging.WARNING, logger="hsoffload"):
        trainer.train()
    assert _train_logs(trainer)[0]["hsoffload/offloaded_tensors"] == 0
    assert "gradient checkpointing" in caplog.text


def _tiny_tokenizer() -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(H.VOCAB)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def test_sft_trainer(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    rows = [{"input_ids": b["input_ids"][0].tolist()} for b in H.batches(8)]
    config = trl.SFTConfig(**current_training_args(dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
    )))
    trainer = enable_hidden_state_offload(
        trl.SFTTrainer(
            model=H.tiny_model("llama"),
            args=config,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=_tiny_tokenizer(),
        ),
        **SCOPE,
    )
    assert isinstance(trainer, trl.SFTTrainer)
    trainer.train()
    logs = _train_logs(trainer)
    assert [entry["hsoffload/offloaded_tensors"] for entry in logs] == [H.LAYERS, H.LAYERS]


def test_sft_trainer_policy_auto_bitwise(tmp_path: Path) -> None:
    """TRL's SFTTrainer with policy auto: the decision in transformers' log, the weights those of SFTTrainer alone."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    rows = [{"input_ids": b["input_ids"][0].tolist()} for b in H.batches(16)]
    config = trl.SFTConfig(**current_training_args(dict(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=2, learning_rate=1e-3,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=7,
        dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False,
    )))
    model = H.tiny_model("llama")
    reference = H.twin(model)

    def sft(m: torch.nn.Module) -> Any:
        return trl.SFTTrainer(model=m, args=config, train_dataset=datasets.Dataset.from_list(rows),
                              processing_class=_tiny_tokenizer())

    with _transformers_warnings() as seen:
        trainer = enable_hidden_state_offload(sft(model), **SCOPE, policy="auto", device_budget=64 << 10)
        trainer.train()
    sft(reference).train()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
    assert any("SFTTrainer: policy auto, decision" in m for m in seen), seen
    last = _train_logs(trainer)[-1]
    assert last["hsoffload/auto_offload_layers"] == H.LAYERS and last["hsoffload/offloaded_tensors"] > 0, last


@pytest.mark.parametrize("policy", ["all", "sac"])
def test_trainer_policies_with_layer_budget_bitwise(tmp_path: Path, policy: str) -> None:
    """The Trainer integration passes policy and layer budget through: bitwise equal to the same training without
    offload, the last layer kept on the device, the per-layer line after the first step."""
    from hsoffload.tools.bench.policies import _sac_context_fn

    layers = 4
    ckpt: dict[str, Any] = {"gradient_checkpointing": False}
    if policy == "sac":
        ckpt = {"gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": {"use_reentrant": False, "context_fn": _sac_context_fn()}}
    args = training_args(tmp_path, **ckpt)
    model = H.tiny_model("llama", layers=layers)
    reference = H.twin(model)
    with _transformers_warnings() as seen:
        trainer = enable_hidden_state_offload(
            transformers.Trainer(model=model, args=args, train_dataset=TokenDataset()),
            **SCOPE, policy=policy, keep_last_layers=1,
        )
        trainer.train()
    transformers.Trainer(model=reference, args=args, train_dataset=TokenDataset()).train()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
    stats = trainer.hsoffload_scope.layer_stats
    assert stats["model.layers.3"].offloaded_tensors == 0 and not stats["model.layers.3"].selected
    assert all(stats[f"model.layers.{i}"].offloaded_tensors > 0 for i in range(3))
    line = [m for m in seen if m.startswith("hsoffload: offload on")]
    assert len(line) == 1 and f"policy={policy}" in line[0] and "model.layers.3: kept (layer budget)" in line[0]


@pytest.mark.parametrize("budget", [64 << 10, 2 << 20])
def test_trainer_policy_auto_bitwise_with_the_decision_logged(tmp_path: Path, budget: int) -> None:
    """policy auto through the Trainer on the CPU (hsoffload's counting CPU allocator): calibrated, decided, the
    decision in transformers' log and as hsoffload/auto_* numbers in the training logs; the weights bit for bit those
    of the same training without hsoffload, whatever it chose. A budget under the leanest choice's peak offloads every
    layer (said in the table); a generous one checkpoints none."""
    args = training_args(tmp_path, max_steps=6, logging_steps=3)
    model = H.tiny_model("llama", layers=4)
    reference = H.twin(model)
    with _transformers_warnings() as seen:
        trainer = enable_hidden_state_offload(
            transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(32)),
            **SCOPE, policy="auto", device_budget=budget, auto_calibration_steps=2,
        )
        trainer.train()
    transformers.Trainer(model=reference, args=args, train_dataset=TokenDataset(32)).train()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
    tables = [m for m in seen if "policy auto, decision" in m]
    assert tables, seen
    logs = _train_logs(trainer)
    last = logs[-1]
    expected = ({"offload": 4, "keep": 0, "none": 0} if budget < 1 << 20 else {"offload": 0, "keep": 0, "none": 4})
    assert {k: last[f"hsoffload/auto_{k}_layers"] for k in expected} == expected, last
    assert last["hsoffload/auto_decisions"] >= 1
    # The two micro-batches of each optimizer step (gradient accumulation 2) run with one decision.
    history = list(auto_controller(model).history)
    assert len(history) == args.max_steps * args.gradient_accumulation_steps - 1  # the last is recorded by the next
    if budget >= 1 << 20:
        pairs = [(history[i].decision_index, history[i + 1].decision_index) for i in range(0, len(history) - 1, 2)]
        assert all(a == b for a, b in pairs) and pairs[-1][0] > 0, pairs
    # Kept for a resumed run, in the output directory (one file per rank).
    assert (tmp_path / "hsoffload_auto" / "rank0.json").exists()
    # The last log's window (3 optimizer steps) runs the decision alone: it offloads exactly when it chose to.
    assert (last["hsoffload/offloaded_tensors"] > 0) == (expected["offload"] > 0), last
    if budget < 1 << 20:
        assert "DOES NOT FIT" in tables[-1]
        assert last["hsoffload/auto_fits"] == 0
    else:
        assert last["hsoffload/auto_fits"] == 1
        assert 0 < last["hsoffload/auto_measured_peak_gib"] <= last["hsoffload/auto_budget_gib"]
