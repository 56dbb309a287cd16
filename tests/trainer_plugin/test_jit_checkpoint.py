"""transformers' own checkpoint on SIGTERM (`enable_jit_checkpoint`) together with obd's `--snapshot-on-sigterm`.

A real Trainer script that turns on `enable_jit_checkpoint`, run by the real daemon with
`--snapshot-on-sigterm`, gets a SIGTERM on its process group as a preempting scheduler sends it:
there must be one checkpoint (not one of obd's and one of transformers'), one proof, and a run
recorded `stopped` with reason `preempted`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, wait_for

transformers = pytest.importorskip("transformers")
HAS_JIT = "enable_jit_checkpoint" in transformers.TrainingArguments.__dataclass_fields__

SCRIPT = """
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, input_ids, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(input_ids.float()).squeeze(-1), labels)}


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x.sum()}


class Slow(TrainerCallback):
    trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.3)

    def on_train_end(self, args, state, control, **kwargs):
        callbacks = [type(cb).__name__ for cb in self.trainer.callback_handler.callbacks]
        print("train() ends; callbacks:", *callbacks, flush=True)


args = TrainingArguments(
    output_dir="mine",
    max_steps=2000,
    per_device_train_batch_size=4,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    use_cpu=True,
    enable_jit_checkpoint=True,
)
slow = Slow()
trainer = Trainer(model=Regression(), args=args, train_dataset=Points(), callbacks=[slow])
slow.trainer = trainer
trainer.train()
print("train() returned", flush=True)
"""


@pytest.mark.skipif(not HAS_JIT, reason=f"transformers {transformers.__version__} has no enable_jit_checkpoint (4.57+)")
def test_with_jit_checkpoint_and_snapshot_on_sigterm_a_sigterm_gives_one_checkpoint_one_proof_and_a_preempted_stop(
    make_daemon, short_tmp: Path
) -> None:
    d: DaemonProc = make_daemon()
    d.start()
    script = short_tmp / "jit_train.py"
    script.write_text(SCRIPT)
    out = d.cli("train", "start", "--snapshot-on-sigterm", "--", sys.executable, str(script))
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()

    def training() -> dict | None:
        record = d.record(rid)
        assert record["state"] in ("preparing", "running"), record["message"]
        return record if record["snapshots"] and (record["progress"]["step"] or 0) >= 3 else None

    record = wait_for(training, 180, 0.2, "the Trainer's third step")
    os.killpg(record["job"]["pid"], signal.SIGTERM)  # what a preempting scheduler does
    record = d.wait_state(rid, "stopped", "failed", "cancelled", "succeeded", timeout=120)
    log = d.cli("train", "logs", rid).stdout
    assert record["state"] == "stopped", f"{record['message']}\n{log[-3000:]}"
    assert record["snapshot"]["reason"] == "preempted" and record["exit_code"] == 0
    callbacks = log.split("train() ends; callbacks:", 1)[1].split("\n", 1)[0].split()
    assert "JITCheckpointCallback" in callbacks and "SnapshotCallback" in callbacks  # both were on
    assert "train() returned" not in log  # the job ended at the snapshot, in train()

    run_dir = Path(record["remote_dir"])
    time.sleep(4)  # longer than transformers' own 3 s wait before it would checkpoint
    checkpoints = sorted(p.name for p in (run_dir / "output").iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints == [f"checkpoint-{record['snapshot']['step']}"]  # one checkpoint: obd's
    assert not (run_dir / "output" / checkpoints[0] / "checkpoint-is-incomplete.txt").exists()
    assert (run_dir / "output" / checkpoints[0] / "trainer_state.json").exists()
    proofs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"end"' in line]
    assert [p.get("snapshot") for p in proofs] == [f"output/{checkpoints[0]}"]  # one proof, one end
    assert json.loads((run_dir / "snapshot.json").read_text())["checkpoint"] == f"output/{checkpoints[0]}"
