"""A user's TRL script that knows nothing of obd (a test fixture): SFTTrainer with a LoRA adapter.

A tiny Qwen2 built from a config and a word-level tokenizer built here, so it runs offline on a
CPU; otherwise what a TRL user writes: a `datasets.Dataset` of texts, an `SFTConfig`, a peft
`LoraConfig`, `SFTTrainer(...).train()`.
"""

from __future__ import annotations

import argparse
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import SFTConfig, SFTTrainer

WORDS = [
    "the",
    "a",
    "run",
    "step",
    "stops",
    "saves",
    "resumes",
    "model",
    "adapter",
    "checkpoint",
    "loss",
    "goes",
    "down",
    "every",
    "time",
]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def texts(n: int = 64) -> list[dict[str, str]]:
    g = torch.Generator().manual_seed(0)
    return [{"text": " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (12,), generator=g))} for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", default="trl-out")
    p.add_argument("--max_steps", type=int, default=8)
    opts = p.parse_args()

    torch.manual_seed(0)
    tok = tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    args = SFTConfig(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        max_length=32,
        dataset_text_field="text",
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(
        model=Qwen2ForCausalLM(config),
        args=args,
        train_dataset=Dataset.from_list(texts()),
        processing_class=tok,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    print(f"trained to step {trainer.state.global_step} of {trainer.state.max_steps}")
    print(f"callbacks: {[type(cb).__name__ for cb in trainer.callback_handler.callbacks]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
