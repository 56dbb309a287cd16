"""A stand-in job that speaks the snapshot protocol badly on purpose, for the daemon's stop tests.

fake_plugin_job.py MODE
ignore      announces snapshots, then never answers a request (a hung step)
hang-after  answers a request with a valid proof and checkpoint, then hangs
proof=JSON  answers a request with this exact snapshot.json, then exits 0
bad-proof-hang  answers a request with an invalid proof, then hangs
nested-metrics  writes a metrics.jsonl first line nested 100,000 deep, then runs
no-plugin   never announces snapshots; runs until killed
snapshot    announces snapshots and logs a step every 0.05 s (from OBD_RESUME_FROM's step when resumed);
            answers a request with a complete checkpoint and a proof of the request's reason, exits 0
ignore-steps  as `snapshot`, but never answers a request (a hung save)
"""

import json
import os
import sys
import time

mode = sys.argv[1]
rd = os.environ["OBD_RUN_DIR"]


def write(path: str, data: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(data)
    os.replace(tmp, path)


if mode == "nested-metrics":
    with open(os.environ["OBD_METRICS_FILE"], "w") as f:
        f.write("[" * 100000 + "\n")
    time.sleep(3600)
if mode != "no-plugin":
    with open(os.environ["OBD_METRICS_FILE"], "a") as f:
        f.write(
            json.dumps({"event": "begin", "time": time.time(), "max_steps": 1000, "snapshots": True, "version": "fake"})
            + "\n"
        )
print("fake job up", flush=True)
step = 0
if mode in ("snapshot", "ignore-steps") and os.environ.get("OBD_RESUME_FROM"):
    step = int(os.environ["OBD_RESUME_FROM"].rstrip("/").rsplit("-", 1)[-1])
    print(f"resumed from step {step}", flush=True)
while True:
    step += 1
    time.sleep(0.05)
    if mode in ("snapshot", "ignore-steps"):
        with open(os.environ["OBD_METRICS_FILE"], "a") as f:
            f.write(json.dumps({"event": "log", "time": time.time(), "step": step, "loss": 1.0 / step}) + "\n")
        if mode == "snapshot" and os.path.exists(os.environ["OBD_SNAPSHOT_REQUEST"]):
            with open(os.environ["OBD_SNAPSHOT_REQUEST"]) as f:
                reason = f.read().strip() or "requested"
            ckpt = f"{rd}/output/checkpoint-{step}"
            os.makedirs(ckpt, exist_ok=True)
            write(f"{ckpt}/trainer_state.json", json.dumps({"global_step": step, "log_history": []}))
            write(f"{ckpt}/model.safetensors", "weights")
            proof = {"checkpoint": f"output/checkpoint-{step}", "step": step, "time": time.time(), "reason": reason}
            write(os.environ["OBD_SNAPSHOT_FILE"], json.dumps(proof))
            print(f"snapshot at step {step} ({reason})", flush=True)
            sys.exit(0)
        continue
    if mode in ("ignore", "no-plugin") or not os.path.exists(os.environ["OBD_SNAPSHOT_REQUEST"]):
        continue
    if mode == "hang-after":
        os.makedirs(f"{rd}/output/checkpoint-{step}")
        write(
            os.environ["OBD_SNAPSHOT_FILE"],
            json.dumps(
                {"checkpoint": f"output/checkpoint-{step}", "step": step, "time": time.time(), "reason": "requested"}
            ),
        )
        print("proof written; now hanging", flush=True)
        time.sleep(3600)
    if mode == "bad-proof-hang":
        write(os.environ["OBD_SNAPSHOT_FILE"], json.dumps({"checkpoint": "../../etc", "step": step}))
        time.sleep(3600)
    if mode.startswith("proof="):
        os.makedirs(f"{rd}/output/checkpoint-{step}", exist_ok=True)
        proof = mode[len("proof=") :]
        if proof == "@huge":
            proof = json.dumps({"checkpoint": f"output/checkpoint-{step}", "step": step, "pad": "x" * 70000})
        write(os.environ["OBD_SNAPSHOT_FILE"], proof.replace("STEP", str(step)))
        sys.exit(0)
