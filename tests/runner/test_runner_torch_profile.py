"""The torch.profiler path on the CPU: a real tiny model trained a few steps, profiled, parsed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from runner.assemble import parse_run
from runner.format import format_metrics

torch = pytest.importorskip("torch")
from trainer_plugin.plugin.torch_profile import StepProfiler

# torch is imported only where it is installed, so its classes are untyped (Any) to the type checker.
Module: Any = torch.nn.Module

VOCAB, WIDTH, SEQ, BATCH = 64, 32, 16, 4


class TinyLM(Module):
    """Embedding, one self-attention through SDPA, a projection back to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        return self.out(x)


def train(run_dir: Path, steps: int = 7, fetch_s: float = 0.004, **profiler_args) -> StepProfiler:
    """A plain training loop with the plugin's metrics.jsonl lines and the profiler hooks around each step."""
    torch.manual_seed(0)
    model = TinyLM()
    model.embed.requires_grad_(False)  # LoRA-like: not every parameter trains
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    profiler = StepProfiler(str(run_dir / "profile"), **profiler_args)
    profiler.note_model(model)
    lines = [
        {"event": "begin", "time": time.time(), "max_steps": steps, "snapshots": True, "start_step": 0, "world_size": 1}
    ]
    tokens = 0
    for step in range(1, steps + 1):
        time.sleep(fetch_s)  # the batch fetch happens between step_end and the next step_begin
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        profiler.step_begin(step)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), ids.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        profiler.step_end(step)
        tokens += ids.numel()
        lines.append({"event": "log", "time": time.time(), "step": step, "loss": loss.item(), "tokens": tokens})
    lines.append({"event": "end", "time": time.time(), "step": steps})
    profiler.close()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return profiler


def test_a_tiny_cpu_training_loop_is_profiled_for_a_bounded_window_and_parses_into_run_metrics(tmp_path):
    profiler = train(tmp_path, steps=7, wait=1, warmup=1, active=3)
    assert profiler.state == "done" and profiler.errors == []
    summary = json.loads((tmp_path / "profile" / "torch_profile.json").read_text())
    assert summary["window"]["profiled_steps"] == [3, 4, 5]
    assert summary["device"]["kind"] == "cpu"
    assert summary["steps"]["in_step"]["count"] == 7  # every step is timed, not only the window
    assert summary["model"]["trainable_params"] < summary["model"]["params"]
    header = (tmp_path / "profile" / "torch_kernels.csv").read_text().splitlines()[0]
    assert header == "name,calls,total_us,device"

    metrics = parse_run(tmp_path / "profile", tmp_path / "metrics.jsonl")
    assert metrics.runner_kind == "live" and metrics.profiler == "torch.profiler" and metrics.device_kind == "cpu"
    assert metrics.steps == 7
    assert metrics.tokens_per_sec and metrics.tokens_per_sec > 0
    assert metrics.top_kernels and all(k.name and k.calls for k in metrics.top_kernels)
    assert sum(k.pct_time for k in metrics.top_kernels) + metrics.other_kernels_pct == pytest.approx(100)
    assert "CPU operators" in metrics.sources["top_kernels"]
    assert metrics.attention_kernel_loaded is True  # aten::_scaled_dot_product_flash_attention_for_cpu
    assert metrics.waste_budget.data_wait is not None and metrics.waste_budget.data_wait >= 0.003
    assert metrics.waste_budget.useful_gpu is None  # no GPU: the GPU buckets do not apply
    assert metrics.mfu_pct is None and metrics.hbm_peak_gb is None
    assert metrics.pytorch_version == torch.__version__
    assert "torch.profiler" in format_metrics(metrics.model_dump(mode="json"))


def test_the_math_attention_path_is_not_reported_as_a_fused_attention_kernel(tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        train(tmp_path, steps=3, fetch_s=0.0, wait=0, warmup=1, active=1)
    metrics = parse_run(tmp_path / "profile", tmp_path / "metrics.jsonl")
    assert metrics.attention_kernel_loaded is False


def test_a_run_shorter_than_the_window_still_writes_what_it_profiled(tmp_path):
    profiler = train(tmp_path, steps=2, fetch_s=0.0, wait=1, warmup=1, active=3)
    assert any("before the window" in e for e in profiler.errors)
    summary = json.loads((tmp_path / "profile" / "torch_profile.json").read_text())
    assert summary["steps"]["in_step"]["count"] == 2
    metrics = parse_run(tmp_path / "profile", tmp_path / "metrics.jsonl")
    assert any("before the window" in w for w in metrics.warnings)


def test_the_profiler_never_raises_into_training_even_when_its_directory_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    profiler = StepProfiler(str(blocker / "profile"))
    profiler.step_begin(1)
    profiler.step_end(1)
    profiler.close()
    assert profiler.errors


@pytest.mark.slow
def test_a_real_transformers_trainer_with_a_step_profiler_callback_parses_into_run_metrics(tmp_path):
    """About 20 s on two CPU cores (transformers' import dominates): run with `-m slow`."""
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)

    Dataset: Any = torch.utils.data.Dataset
    Callback: Any = transformers.TrainerCallback

    class Tokens(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    lines: list[dict] = []

    class Profiled(Callback):
        """What the obd Trainer callback does with OBD_TORCH_PROFILE=1, plus the metrics.jsonl lines."""

        def __init__(self) -> None:
            self.profiler = StepProfiler(str(tmp_path / "profile"), wait=1, warmup=1, active=2)
            self.tokens = 0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.profiler.note_model(model)
            lines.append(
                {
                    "event": "begin",
                    "time": time.time(),
                    "max_steps": state.max_steps,
                    "snapshots": True,
                    "start_step": 0,
                    "world_size": 1,
                }
            )

        def on_step_begin(self, args, state, control, **kwargs):
            self.profiler.step_begin(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            self.profiler.step_end(state.global_step)
            self.tokens += 4 * 16
            lines.append({"event": "log", "time": time.time(), "step": state.global_step, "tokens": self.tokens})

        def on_train_end(self, args, state, control, **kwargs):
            self.profiler.close()
            lines.append({"event": "end", "time": time.time(), "step": state.global_step})

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "output"),
        max_steps=6,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=10,
    )
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Profiled()]).train()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    metrics = parse_run(tmp_path / "profile", tmp_path / "metrics.jsonl")
    assert metrics.profiler == "torch.profiler" and metrics.device_kind == "cpu"
    assert metrics.steps == 6 and (metrics.tokens_per_sec or 0) > 0
    assert any(k.name == "aten::mm" for k in metrics.top_kernels)
    assert metrics.attention_kernel_loaded is True
    assert metrics.waste_budget.data_wait is not None
