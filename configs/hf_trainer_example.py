"""Plain HF Trainer with hidden-state offload: one line on top of an ordinary Trainer.

Runs anywhere (CPU included) in about a minute with a tiny randomly initialised Llama, no downloads:
    python configs/hf_trainer_example.py
For a real run, load your model with from_pretrained and drop `offload_cpu_tensors` (that knob only
makes CPU-only runs copy data, to show the counters moving).
"""

from __future__ import annotations

import logging

import torch
import transformers

from hsoffload.integrations import enable_hidden_state_offload


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    args = transformers.TrainingArguments(
        output_dir="outputs/hf-trainer-hsoffload",
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=2,                       # hsoffload/* keys are added to each training log
        activation_checkpointing=True,         # required: checkpointed layer inputs are what is offloaded
        activation_checkpointing_kwargs={"use_reentrant": False},  # before transformers 5.23: gradient_checkpointing*
        report_to=[],
        save_strategy="no",
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(64, 64, config.vocab_size))
    # The one line: every training step (forward + backward) runs inside an offload scope.
    enable_hidden_state_offload(trainer, offload_cpu_tensors=not torch.cuda.is_available(), min_offload_size=0)
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({k: v for k, v in entry.items() if k == "loss" or k.startswith("hsoffload/")})


if __name__ == "__main__":
    main()
