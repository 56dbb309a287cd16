"""A stop honoured wherever the job's time goes (issue 32), with real Trainer processes in a run
directory laid out as obd lays it out: inside an evaluation, inside a long gradient accumulation,
inside a data-loader fetch that does not return, and after train(). Each stop gives a proof of the
last completed optimizer step, and the run resumed from it trains every later step bitwise as a
run never stopped (CPU), the interrupted evaluation performed first.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.trainer_plugin.conftest import JOB_TIMEOUT, SCRIPTS, RunDir, read_jsonl, torchrun

pytest.importorskip("transformers")

SCRIPT = str(SCRIPTS / "phases_trainer.py")
STEPS, ACCUMULATION, EVAL_STEPS = 12, 20, 5
BASE = ["--max_steps", str(STEPS), "--accumulation", str(ACCUMULATION), "--eval_steps", str(EVAL_STEPS)]


class Job:
    """One run of the script in its own run directory, its output in job.log."""

    def __init__(self, root: Path, *args: str, resume_from: Path | None = None, ranks: int = 1) -> None:
        self.run = RunDir(root)
        self._log = open(self.run.log, "wb")
        launch = torchrun(root, ranks)
        self.proc = subprocess.Popen(
            [*(launch if ranks > 1 else [sys.executable]), SCRIPT, *BASE, *args],
            env=self.run.env(resume_from),
            cwd=root,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.run.log.read_text(errors="replace")

    def wait_line(self, text: str) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None or text in self.log(), f"the job ended first:\n{self.log()[-3000:]}"
            return text in self.log()

        wait_for(seen, JOB_TIMEOUT, 0.1, repr(text))

    def finish(self) -> int:
        try:
            return self.proc.wait(JOB_TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()

    def lines(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run.metrics_path)

    def steps(self) -> dict[int, tuple[float, float]]:
        return {x["step"]: (x["loss"], x["grad_norm"]) for x in self.lines() if x["event"] == "log" and "loss" in x}

    def evaluations(self) -> dict[int, float]:
        return {x["step"]: x["eval_loss"] for x in self.lines() if x["event"] == "metrics" and "eval_loss" in x}

    def counts(self) -> tuple[str, int]:
        """The training's FLOP count (the script prints it after train()) and its token count (the `end` line)."""
        flos = [line.split()[1] for line in self.log().splitlines() if line.startswith("total_flos ")]
        tokens = [x["tokens"] for x in self.lines() if x["event"] == "end"]
        return flos[-1], tokens[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The same training never stopped."""
    job = Job(tmp_path_factory.mktemp("reference"))
    assert job.finish() == 0, job.log()[-3000:]
    assert max(job.steps()) == STEPS
    return job


def after_step_end(job: Job, line: str, whole: bool = False) -> None:
    """Wait for `line`, then for the step end after it: a stop then comes inside the 20 micro-batches of the next step.
    `whole`: for the end of a step slow from its first micro-batch (the step that ends first may have
    turned slow only at its last, and a step under FULL_RNG_STEP_SECONDS keeps no numpy or Python RNG:
    a rank that cannot be interrupted then leaves the stop to the step end, as interrupt.py says).

    The script says `step N ended` in its own step-end callback, before obd's looks at the request
    at that step end: the wait goes on to the Trainer's log of step N, printed once every rank is
    past it (a request written in between, on a loaded machine, is a stop at that step end)."""
    job.wait_line(line)
    began = job.log().index(line)
    wait_for(lambda: " ended" in job.log()[began:] or job.proc.poll() is not None, JOB_TIMEOUT, 0.05, "a step end")
    found = re.search(r"step (\d+) ended", job.log()[began:])
    if found is None:
        return
    end = f"step {int(found.group(1)) + 1 if whole else found.group(1)} ended"
    wait_for(lambda: end in job.log() or job.proc.poll() is not None, JOB_TIMEOUT, 0.05, end)
    if end in job.log():
        at = job.log().index(end)
        wait_for(
            lambda: "{'loss'" in job.log()[at:] or job.proc.poll() is not None, JOB_TIMEOUT, 0.05, f"{end}: its log"
        )


def stop_and_resume(job: Job, root: Path, reference: Job, *, cut: str, ranks: int = 1) -> tuple[dict, Job]:
    """Ask the job for a snapshot now; then resume from it, and check every later step against the reference."""
    job.run.request.write_text("requested")
    assert job.finish() == 0, job.log()[-3000:]
    proof = job.run.proof()
    assert proof is not None, job.log()[-5000:]
    step = proof["step"]
    assert f"the stop came during {cut}" in job.log(), job.log()[-6000:]
    assert max(job.steps()) == step  # the snapshot is the last completed step, none begun after it
    checkpoint = job.run.output / f"checkpoint-{step}"
    resumed = Job(root, resume_from=checkpoint, ranks=ranks)
    assert resumed.finish() == 0, resumed.log()[-3000:]
    after = resumed.steps()
    assert min(after) == step + 1 and max(after) == STEPS
    assert after == {s: reference.steps()[s] for s in after}  # bitwise: losses and gradient norms
    assert resumed.counts() == reference.counts()  # the snapshot's FLOP and token counts were step N's
    return proof, resumed


def test_a_stop_during_an_evaluation_is_taken_between_two_batches_and_the_resumed_run_evaluates_first(
    tmp_path: Path, reference: Job
) -> None:
    slow = tmp_path / "slow-eval"
    slow.write_text("")
    job = Job(tmp_path / "a", "--slow-eval", str(slow))
    job.wait_line("slow evaluation began")  # at step 5: 40 samples of 0.3 s each
    phases = [x for x in job.lines() if x["event"] == "phase"]
    assert phases[-1]["phase"] == "evaluating" and phases[-1]["step"] == EVAL_STEPS
    proof, resumed = stop_and_resume(job, tmp_path / "b", reference, cut="evaluating")
    assert proof["step"] == EVAL_STEPS
    assert EVAL_STEPS not in job.evaluations()  # cut short: no point from the stopped run
    # ...and performed first by the resumed run, on the same model: the same number.
    assert resumed.evaluations() == reference.evaluations()
    assert "performing it first" in resumed.log()


def test_a_stop_inside_a_long_gradient_accumulation_saves_the_last_completed_step(
    tmp_path: Path, reference: Job
) -> None:
    slow = tmp_path / "slow-forward"
    # From step 3 on (the script makes the file at step 2's end) a step is 20 forward passes of 0.2 s.
    job = Job(tmp_path / "a", "--slow-forward", str(slow), "--slow-from-step", "2", "--say-steps")
    after_step_end(job, "slow forward passes began")
    proof, _ = stop_and_resume(job, tmp_path / "b", reference, cut="training")
    assert 2 <= proof["step"] < STEPS


def test_a_stop_inside_a_data_loader_fetch_that_never_returns_interrupts_it(tmp_path: Path, reference: Job) -> None:
    stall = tmp_path / "stall"
    stall.write_text("")
    fetch = ACCUMULATION * 2 * 3 + 7  # a sample of step 4's accumulation
    job = Job(tmp_path / "a", "--stall-fetch", str(fetch), "--stall-file", str(stall))
    job.wait_line("stalled in sample")
    # A fetch that lasts is said (status: `loading data`), once, not at every step's fetch.
    wait_for(
        lambda: [x["phase"] for x in job.lines() if x["event"] == "phase"][-1:] == ["loading_data"],
        JOB_TIMEOUT,
        0.1,
        "the loading_data line",
    )
    assert sum(x.get("phase") == "loading_data" for x in job.lines()) == 1
    job.run.request.write_text("requested")
    assert job.finish() == 0, job.log()[-3000:]
    assert "the stop came during loading_data" in job.log()
    stall.unlink()  # the resumed run passes that sample
    proof = job.run.proof()
    assert proof["step"] == 3 and max(job.steps()) == 3
    resumed = Job(
        tmp_path / "b",
        "--stall-fetch",
        str(fetch),
        "--stall-file",
        str(stall),
        resume_from=job.run.output / "checkpoint-3",
    )
    assert resumed.finish() == 0, resumed.log()[-3000:]
    after = resumed.steps()
    assert min(after) == 4 and after == {s: reference.steps()[s] for s in after}
    assert resumed.counts() == reference.counts()


def test_a_run_stopped_inside_a_step_and_resumed_counts_the_flops_and_tokens_of_a_run_never_stopped(
    tmp_path: Path, reference: Job
) -> None:
    """The snapshot keeps the FLOPs of its step that the Trainer had not yet added to total_flos
    (it adds them at the step's log, after the step end) and drops the abandoned micro-batches'."""
    slow = tmp_path / "slow-micro"
    # From step 3 on (the script makes the file at step 2's end) a sample takes 0.2 s: a step's fetch 8 s.
    job = Job(tmp_path / "a", "--slow-micro", str(slow), "--slow-from-step", "2", "--say-steps")
    job.wait_line("slow micro-batches began")
    proof, resumed = stop_and_resume(job, tmp_path / "b", reference, cut="loading_data")
    assert 2 <= proof["step"] < STEPS
    assert resumed.counts() == reference.counts()


def test_a_stop_after_train_returned_says_which_code_it_cuts_short(tmp_path: Path) -> None:
    job = Job(tmp_path, "--max_steps", "3", "--after-train", "600")
    job.wait_line("after-train code began")
    job.run.request.write_text("requested")
    line = wait_for(
        lambda: next((x for x in job.lines() if x["event"] == "phase" and x.get("cut")), None),
        JOB_TIMEOUT,
        0.1,
        "the after-train line",
    )
    assert line["phase"] == "after_train" and line["step"] == 3 and "phases_trainer.py:" in line["cut"]
    assert not job.run.proof_path.exists()  # training had finished: there is nothing to snapshot
    job.proc.kill()
    job.finish()


@pytest.fixture(scope="module")
def reference_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The same training on two ranks (torchrun, gloo), never stopped."""
    job = Job(tmp_path_factory.mktemp("reference-2"), ranks=2)
    assert job.finish() == 0, job.log()[-3000:]
    assert max(job.steps()) == STEPS
    return job


def test_two_ranks_one_in_an_evaluation_batch_and_one_waiting_for_it_stop_at_one_step_and_resume_exactly(
    tmp_path: Path, reference_on_two_ranks: Job
) -> None:
    slow = tmp_path / "slow-eval"
    slow.write_text("")
    # Rank 0 takes 0.6 s for each evaluation batch; rank 1 waits for it in the batch's gather.
    job = Job(tmp_path / "a", "--slow-eval", str(slow), "--slow-rank", "0", ranks=2)
    job.wait_line("slow evaluation began")
    proof, resumed = stop_and_resume(job, tmp_path / "b", reference_on_two_ranks, cut="evaluating", ranks=2)
    assert proof["step"] == EVAL_STEPS
    # One snapshot, taken by both ranks at the same step, and both ended (torchrun exited 0).
    assert job.log().count(f"the snapshot is the state at the end of step {EVAL_STEPS}") == 2
    assert job.log().count("obd: snapshot at step") == 1
    checkpoint = job.run.output / f"checkpoint-{EVAL_STEPS}"
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    # The interrupted evaluation is performed first by the resumed ranks: the chain has its point.
    assert resumed.evaluations() == reference_on_two_ranks.evaluations()


def test_two_ranks_inside_a_long_accumulation_agree_on_one_micro_batch_and_resume_exactly(
    tmp_path: Path, reference_on_two_ranks: Job
) -> None:
    slow = tmp_path / "slow-forward"
    # Between two optimizer steps there is no collective: each rank runs its micro-batches at its
    # own pace, and the ranks must agree on the micro-batch where both stop.
    # From step 3 on (each rank makes the file at step 2's end) a step is 20 forward passes of 0.2 s.
    job = Job(tmp_path / "a", "--slow-forward", str(slow), "--slow-from-step", "2", "--say-steps", ranks=2)
    after_step_end(job, "slow forward passes began", whole=True)
    proof, _ = stop_and_resume(job, tmp_path / "b", reference_on_two_ranks, cut="training", ranks=2)
    assert 2 <= proof["step"] < STEPS
    assert job.log().count(f"the snapshot is the state at the end of step {proof['step']}") == 2
