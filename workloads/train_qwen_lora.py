"""Qwen2.5 LoRA fine-tuning with peft and transformers.Trainer on instruction/response pairs.

An ordinary training script: it knows nothing of obd (obd's sitecustomize adds snapshots,
metrics and the output directory from the outside). `--tiny` swaps the hub model for a tiny
random Qwen2 and a word-level tokenizer built from the data, so the same code path runs
offline on a CPU in seconds (tests, demos, benchmarks):

    python workloads/train_qwen_lora.py --model Qwen/Qwen2.5-0.5B --data my.jsonl --output_dir out
    python workloads/train_qwen_lora.py --tiny --max_steps 20 --output_dir /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "tiny_instructions.jsonl"
IM_START, IM_END, PAD, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<unk>"
IGNORE = -100  # label of prompt and padding positions: the loss covers the response only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B", help="local path or hub id (ignored with --tiny)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help='jsonl of {"instruction": ..., "response": ...}')
    p.add_argument("--output_dir", default="output")
    p.add_argument("--max_steps", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--lora_rank", type=int, default=8)
    p.add_argument("--lora_targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names")
    p.add_argument("--save_steps", type=int, default=0, help="also save every N steps (0: only at the end)")
    p.add_argument("--learning_rate", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="tiny random Qwen2 and a local tokenizer: offline, CPU, seconds")
    return p.parse_args(argv)


def load_pairs(path: str) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        pairs = [json.loads(line) for line in f if line.strip()]
    if not pairs:
        raise SystemExit(f"no examples in {path}")
    return pairs


def prompt_text(instruction: str) -> str:
    """Qwen's ChatML turn layout, so the tiny and the real model see the same text."""
    return f"{IM_START}user\n{instruction}{IM_END}\n{IM_START}assistant\n"


def build_tiny_tokenizer(pairs: list[dict[str, str]]) -> Any:
    """A word-level tokenizer over the data's words: deterministic (sorted vocabulary) and instant."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    splitter = pre_tokenizers.Whitespace()
    words: set[str] = {"user", "assistant"}
    for pair in pairs:
        for text in (pair["instruction"], pair["response"]):
            words.update(piece for piece, _span in splitter.pre_tokenize_str(text))
    specials = [PAD, UNK, IM_START, IM_END]
    vocab = {token: i for i, token in enumerate(specials + sorted(words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = splitter
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=IM_END)


def build_tiny_model(tokenizer: Any, seq_len: int, seed: int) -> Any:
    """A 2-layer, 64-wide Qwen2 with random weights (about 0.15 M parameters)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(seq_len, 128),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_model_and_tokenizer(args: argparse.Namespace, pairs: list[dict[str, str]]) -> tuple[Any, Any]:
    if args.tiny:
        tokenizer = build_tiny_tokenizer(pairs)
        return build_tiny_model(tokenizer, args.seq_len, args.seed), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Base weights in the training precision; peft keeps the adapters in fp32 (autocast_adapter_dtype).
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model, tokenizer


def add_lora(model: Any, args: argparse.Namespace) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_dropout=0.0 if args.tiny else 0.05,
        target_modules=[t.strip() for t in args.lora_targets.split(",") if t.strip()],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


class PairDataset(torch.utils.data.Dataset):
    """Tokenized examples: prompt tokens labelled IGNORE, response tokens (and end of turn) learnt."""

    def __init__(self, pairs: list[dict[str, str]], tokenizer: Any, seq_len: int) -> None:
        self.examples = [self._encode(p, tokenizer, seq_len) for p in pairs]

    @staticmethod
    def _encode(pair: dict[str, str], tokenizer: Any, seq_len: int) -> dict[str, list[int]]:
        # Prompt and response are tokenized apart, so the label boundary is exact for any tokenizer.
        prompt = tokenizer(prompt_text(pair["instruction"]), add_special_tokens=False)["input_ids"]
        response = tokenizer(pair["response"] + IM_END, add_special_tokens=False)["input_ids"]
        ids = (prompt + response)[:seq_len]
        labels = ([IGNORE] * len(prompt) + response)[:seq_len]
        return {"input_ids": ids, "labels": labels}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


class PadCollator:
    """Right-pads a batch to its longest example."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(ex["input_ids"]) for ex in batch)

        def pad(values: list[int], fill: int) -> list[int]:
            return values + [fill] * (width - len(values))

        return {
            "input_ids": torch.tensor([pad(ex["input_ids"], self.pad_id) for ex in batch]),
            "attention_mask": torch.tensor([pad([1] * len(ex["input_ids"]), 0) for ex in batch]),
            "labels": torch.tensor([pad(ex["labels"], IGNORE) for ex in batch]),
        }


def training_arguments(args: argparse.Namespace) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=args.save_steps if args.save_steps > 0 else 500,
        bf16=args.precision == "bf16",
        fp16=args.precision == "fp16",
        seed=args.seed,
        report_to="none",
        remove_unused_columns=False,  # our dataset yields exactly the model's inputs
        dataloader_num_workers=0,
        disable_tqdm=not sys.stderr.isatty(),  # a log file gets one line per log instead of bars
    )


def train_end_reporter() -> Any:
    """A callback that prints, on every rank, the step and epoch its training ended at
    (`train_end {...}`): inside train(), so it is said for a run stopped for a snapshot too."""
    from transformers import TrainerCallback

    class TrainEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            rank = int(os.environ.get("RANK", "0"))
            print(
                "train_end " + json.dumps({"rank": rank, "step": state.global_step, "epoch": state.epoch}), flush=True
            )

    return TrainEnd()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import Trainer, set_seed

    set_seed(args.seed)
    pairs = load_pairs(args.data)
    model, tokenizer = load_model_and_tokenizer(args, pairs)
    model = add_lora(model, args)
    trainer = Trainer(
        model=model,
        args=training_arguments(args),
        train_dataset=PairDataset(pairs, tokenizer, args.seq_len),
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[train_end_reporter()],
    )
    # Under obd, a stop for a snapshot ends the job inside train() (exit 0, the checkpoint proven):
    # the lines below run only when training reached max_steps, so the adapter saved here is
    # always the trained one, never a half-trained "final" one.
    result = trainer.train()
    trainer.save_model()  # the adapter, in output_dir
    print("train_metrics " + json.dumps(result.metrics), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
