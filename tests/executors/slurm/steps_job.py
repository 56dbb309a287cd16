"""A custom training loop for the Slurm tests: a fixed step time, no torch (it starts in a blink).

    steps_job.py STEP_TIME MAX_STEPS [RESUMED_STEP_TIME]

It resumes after the step of OBD_RESUME_FROM's checkpoint (then taking RESUMED_STEP_TIME per
step, when given), logs every step, saves a checkpoint and its proof when a snapshot is asked
for, and otherwise ends at MAX_STEPS with exit 0.
"""

import os
import re
import socket
import sys
import time

import trainer_plugin as obd

step_time, max_steps = float(sys.argv[1]), int(sys.argv[2])
resumed = obd.resume_from()
step = int(re.findall(r"checkpoint-(\d+)", resumed)[-1]) if resumed else 0
if resumed and len(sys.argv) > 3:
    step_time = float(sys.argv[3])
obd.begin(max_steps=max_steps, start_step=step)
print(f"steps job on {os.environ.get('SLURMD_NODENAME', socket.gethostname())} from step {step}", flush=True)
while step < max_steps:
    time.sleep(step_time)
    step += 1
    obd.log_metrics(step, loss=1.0 / step)
    reason = obd.snapshot_requested()
    if reason and step < max_steps:
        path = obd.checkpoint_dir(step)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.txt"), "w") as f:
            f.write(f"{step}\n")
        obd.write_proof(step, reason=reason)
        obd.end(step)
        print(f"snapshot at step {step} ({reason})", flush=True)
        sys.exit(0)
obd.end(step)
print(f"done at step {step}", flush=True)
