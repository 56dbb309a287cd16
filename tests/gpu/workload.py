"""The GPU check's training job: a Qwen2 built from a config (no download), trained with transformers.Trainer.

An ordinary Trainer script that knows nothing of obd, like workloads/train_qwen_lora.py, but
sized for a GPU: the default model has the shape of Qwen2.5-0.5B (24 layers, 896 wide, 14 query
and 2 key/value heads, MLP 4864) with a 32768-token vocabulary, about 390 M parameters, built
from a `Qwen2Config` with seeded random weights. The data are seeded random token sequences of a
fixed length (no tokenizer, no padding), so every step has the same shape and the same cost, and
two runs with the same seed see the same batches.

    python tests/gpu/workload.py --mode lora --max_steps 300 --output_dir out [--deterministic]
    python tests/gpu/workload.py --mode full --size tiny --max_steps 20 --output_dir out   # CPU, seconds

- `--mode lora`: the base weights in bf16, LoRA adapters (rank 16, dropout 0.05) on the
  attention and MLP projections in fp32 (peft's default), the Trainer's bf16 autocast.
- `--mode full`: every weight trains, fp32 master weights under the Trainer's bf16 autocast.
- `--deterministic`: `torch.use_deterministic_algorithms(True)` with `CUBLAS_WORKSPACE_CONFIG`
  set before CUDA starts, so two runs with the same seed compute bit-identical steps.
- `--timings FILE`: the script's own callback writes the wall time of every step (from one step
  end to the next; the Trainer logs every step, which waits for the GPU) and the step it ended
  at; under torchrun each rank writes `FILE.rank<N>`. It is the same callback with or without
  obd, so the benchmark compares like with like.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    # The shape of Qwen2.5-0.5B with a smaller vocabulary: about 390 M parameters (tied embeddings).
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 32768,
    },
    # A few million parameters: the same code path on a CPU in seconds (the harness's dry run).
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--output_dir", default="output")
    p.add_argument("--max_steps", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--examples", type=int, default=4096, help="random sequences in the dataset")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--learning_rate", type=float, default=None, help="default: 2e-4 for lora, 2e-5 for full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms, bit-identical reruns")
    p.add_argument("--timings", help="write the wall time of every step here (rank N > 0: FILE.rankN)")
    return p.parse_args(argv)


def set_deterministic() -> None:
    """Deterministic kernels; cuBLAS needs its workspace setting before CUDA starts, so this runs before any CUDA call."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_model(args: argparse.Namespace) -> Any:
    """A Qwen2 of `args.size` with seeded random weights, built on the GPU (fast) and shaped for `args.mode`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    config = Qwen2Config(
        **SIZES[args.size],
        max_position_embeddings=max(args.seq_len, 128),
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    with device():
        model = Qwen2ForCausalLM(config)
    if args.mode == "full":
        return model  # fp32 master weights; the Trainer's bf16 autocast does the matrix work in bf16
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def random_tokens(args: argparse.Namespace) -> Any:
    """`args.examples` sequences of `args.seq_len` token ids, the same for every run with this seed."""
    import torch

    generator = torch.Generator().manual_seed(1000 + args.seed)
    vocab = SIZES[args.size]["vocab_size"]
    return torch.randint(0, vocab, (args.examples, args.seq_len), generator=generator)


class Tokens:
    """A map-style dataset over a tensor of token ids: each row is its own labels (causal LM)."""

    def __init__(self, ids: Any) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.ids[index]
        return {"input_ids": row, "labels": row}


def step_timer(path: str | None) -> Any:
    """The script's own callback: wall time of each step and the step training ended at (see the module doc)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.started: float | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rank = int(os.environ.get("RANK", "0"))
            out = {
                "rank": rank,
                "global_step": state.global_step,
                "max_steps": state.max_steps,
                "first_step_s": self.ends[0] - self.started if self.ends and self.started else None,
                "step_s": [b - a for a, b in itertools.pairwise(self.ends)],
            }
            if path:
                target = Path(path if rank == 0 else f"{path}.rank{rank}")
                target.write_text(json.dumps(out))
            print(
                f"workload: training ended at step {state.global_step} of {state.max_steps} (rank {rank})", flush=True
            )

    return StepTimer()


def training_arguments(args: argparse.Namespace) -> Any:
    import torch
    from transformers import TrainingArguments

    learning_rate = args.learning_rate if args.learning_rate is not None else (2e-4 if args.mode == "lora" else 2e-5)
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=learning_rate,
        logging_steps=args.logging_steps,
        save_strategy="no",
        bf16=args.precision == "bf16",
        seed=args.seed,
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # the dry run: bf16 autocast on the CPU
    )


def describe(model: Any) -> str:
    """One line on what runs where, for the job log."""
    import torch

    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (
        f"workload: {params / 1e6:.1f} M parameters, {trainable / 1e6:.2f} M trainable, on {where}, "
        f"torch {torch.__version__}, deterministic={torch.are_deterministic_algorithms_enabled()}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.deterministic:
        set_deterministic()
    from transformers import Trainer, set_seed

    set_seed(args.seed)
    model = build_model(args)
    print(describe(model), flush=True)
    trainer = Trainer(
        model=model,
        args=training_arguments(args),
        train_dataset=Tokens(random_tokens(args)),
        callbacks=[step_timer(args.timings)],
    )
    # Under obd, a stop for a snapshot ends the job inside train(); the lines below run only
    # when training reached max_steps.
    result = trainer.train()
    print("train_metrics " + json.dumps(result.metrics), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
