"""A stand-in job for retry chains: each attempt of the chain follows its own plan (a test fixture).

fake_chain_job.py LEDGER PLAN1 PLAN2 ...

Attempt k (the k-th time the job starts, counted by the lines in LEDGER) follows PLANk, a
comma-separated list of actions, and first appends `start <OBD_RUN_ID> <OBD_RESUME_FROM or ->`
to LEDGER:
  save=N   a complete checkpoint `output/checkpoint-N` (trainer_state.json at step N, weights)
  half=N   a half-written one (weights, no trainer_state.json: a save cut short)
  sleep=S  sleep S seconds
  exit=C   exit with code C (the default at the end of a plan: 0)
"""

import json
import os
import sys
import time

ledger, plans = sys.argv[1], sys.argv[2:]
with open(ledger, "a+") as f:
    f.seek(0)
    attempt = len(f.read().splitlines())
    f.write(f"start {os.environ['OBD_RUN_ID']} {os.environ.get('OBD_RESUME_FROM') or '-'}\n")
plan = plans[min(attempt, len(plans) - 1)]
print(f"attempt {attempt + 1}: {plan}", flush=True)
for action in plan.split(","):
    what, _, arg = action.partition("=")
    if what in ("save", "half"):
        checkpoint = os.path.join(os.environ["OBD_OUTPUT_DIR"], f"checkpoint-{arg}")
        os.makedirs(checkpoint)
        with open(os.path.join(checkpoint, "adapter_model.safetensors"), "wb") as f:
            f.write(b"weights")
        if what == "save":
            with open(os.path.join(checkpoint, "trainer_state.json"), "w") as f:
                json.dump({"global_step": int(arg)}, f)
    elif what == "sleep":
        time.sleep(float(arg))
    elif what == "exit":
        sys.exit(int(arg))
