"""A custom training loop that uses obd's helpers: fixed step time, a small checkpoint, a proof."""

import os
import sys
import time

import trainer_plugin as obd

step_time = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
obd.begin(max_steps=100000)
step = 0
while True:
    time.sleep(step_time)
    step += 1
    obd.log_metrics(step, loss=1.0 / step)
    reason = obd.snapshot_requested()
    if reason:
        path = obd.checkpoint_dir(step)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.bin"), "wb") as f:
            f.write(b"\0" * 1024)
            f.flush()
            os.fsync(f.fileno())
        obd.write_proof(step, reason=reason)
        obd.end(step)
        sys.exit(0)
