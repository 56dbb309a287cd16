"""obd's side of a Slurm job, run on the cluster (standard library only).

The Slurm executor installs this file beside jobctl.py and rundir.py on the machine where
sbatch works (this one, or a login node) and every run's `plugin/` carries it to the compute
nodes through the shared workdir. Its commands:

    python3 slurm_batch.py submit RUN_DIR < {"sbatch": [...], "script": ..., "env": {...}}
    python3 slurm_batch.py probe < {"runs": [{"dir": ..., "job_id": ...}, ...]}
    python3 slurm_batch.py cancel RUN_DIR [--grace S] [--job-id ID]
    python3 slurm_batch.py put PATH < bytes  # a file the daemon writes in a user's run directory
    python3 slurm_batch.py batch RUN_DIR     # the batch script execs this on the first node
    python3 slurm_batch.py node RUN_DIR      # srun runs this on every node of a multi-node job

Under a root daemon the helper runs as the run's user (`executors/slurm/as_user.py`), so every
Slurm command and every file it writes is theirs. `submit` writes its intent into the run directory before sbatch and the job id right after,
and submits nothing when the run already has a job (by id, or by its name `obd-<run id>`), so
a daemon killed between the submit and its record never gets a second job. `probe` reads every
run directory and asks `squeue` once for all of them. `batch` is the job wrapper of a Slurm job:
it writes `job.pid`, and on every end its end marker (`slurm_end.json`, then `exit_code`), which
the daemon reads without asking Slurm unless it shows Slurm's hand (`contested`), turns Slurm's USR1 (sent
`signal_margin` before the time limit) into a `deadline` snapshot request and a TERM that is not
obd's cancel into a `preempted` one, and launches the command on every node with srun.
Values (environment, secrets) reach sbatch on stdin and the job through its environment, never
a command line or a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

try:  # imported as trainer_plugin.tools.slurm_batch
    from .. import rundir
    from . import jobctl
except ImportError:  # run by path beside jobctl.py, which finds rundir.py
    import jobctl  # type: ignore[no-redef, import-not-found]

    rundir = jobctl.rundir

SUBMIT_GRACE = 120.0  # a submit whose intent is younger than this may still be under way

# Slurm job states (squeue %T), by what they mean for obd.
PENDING_STATES = frozenset(
    {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT", "CONFIGURING"}
)
ACTIVE_STATES = frozenset(
    {
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
        "UPDATE_DB",
        "POWER_UP_NODE",
    }
)
# Variables of the submitting environment a job keeps (the rest of it, such as the daemon's own
# secrets, never reaches a job); obd's values and the target's secrets are added to these.
KEPT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "SHELL", "SLURM_CONF", "TMPDIR")
SQUEUE_FORMAT = "%i|%j|%T|%N|%r"


# --- Slurm commands ------------------------------------------------------------------------


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: {exc}")


def squeue_by_name(names: list[str]) -> tuple[dict[str, list[dict]], str | None]:
    """Every job of this helper's user Slurm still knows under these names (`squeue --me -t all`),
    in one call; or why not. Only the user's own: obd submits a run's job as the run's user, and a
    job someone else named `obd-<run id>` is never taken for the run's."""
    if not names:
        return {}, None
    argv = ["squeue", "--me", "--noheader", "--states=all", f"--name={','.join(names)}", f"--format={SQUEUE_FORMAT}"]
    out = _run(argv)
    if out.returncode != 0:
        return {}, (out.stderr.strip().splitlines() or [f"squeue exited {out.returncode}"])[-1]
    jobs: dict[str, list[dict]] = {}
    for line in out.stdout.splitlines():
        parts = line.split("|", 4)
        if len(parts) == 5:
            job = {"job_id": parts[0], "name": parts[1], "state": parts[2], "nodes": parts[3], "reason": parts[4]}
            jobs.setdefault(parts[1], []).append(job)
    return jobs, None


def job_state(job_id: str) -> str | None:
    """The state of one job of this helper's user (`squeue --me -j`), None when Slurm no longer knows it."""
    out = _run(["squeue", "--me", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"], timeout=30)
    if out.returncode != 0:
        return None if "Invalid job id" in out.stderr else "UNKNOWN"
    states = out.stdout.split()
    return states[0] if states else None


# --- the submit's record in the run directory ------------------------------------------------


def job_name(run_dir: str) -> str:
    """The Slurm job name of a run: `obd-<run id>`, the run id being its directory's name."""
    return "obd-" + os.path.basename(os.path.normpath(run_dir))


def read_submit(run_dir: str) -> dict:
    data = rundir.read_regular(rundir.RunPaths(run_dir).slurm_submit, 4096)
    try:
        value = json.loads(data) if data else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _write_submit(run_dir: str, record: dict) -> None:
    rundir.atomic_write(rundir.RunPaths(run_dir).slurm_submit, json.dumps(record).encode())


def submit_env(values: dict[str, str]) -> dict[str, str]:
    """sbatch's environment (which `--export=ALL` hands to the job): a login's basics and obd's values."""
    env = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith("LC_")}
    env.update(values)
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env


def pick_job(jobs: list[dict], job_id: str | None) -> dict | None:
    """The job of a run among those with its name: the recorded id, else the newest one."""
    if job_id:
        return next((j for j in jobs if j["job_id"] == job_id), None)
    if not jobs:
        return None
    return max(jobs, key=lambda j: int(j["job_id"].split("_")[0]) if j["job_id"].split("_")[0].isdigit() else 0)


def submit(run_dir: str, request: dict) -> dict:
    """Submit the run's batch script once: {"job_id", "reused"}; raises SystemExit with sbatch's error."""
    name = job_name(run_dir)
    known = read_submit(run_dir)
    if known.get("job_id"):
        return {"job_id": known["job_id"], "reused": True}
    found, error = squeue_by_name([name])
    if error is not None:
        raise SystemExit(f"obd: Slurm's controller did not answer squeue: {error}; nothing was submitted")
    existing = pick_job(found.get(name, []), None)
    if existing is not None:  # submitted before, its id never recorded: that job is the run's
        _write_submit(run_dir, {**known, "job_name": name, "job_id": existing["job_id"]})
        return {"job_id": existing["job_id"], "reused": True}
    _write_submit(run_dir, {"job_name": name, "submitting": time.time(), "job_id": None})
    argv = ["sbatch", "--parsable", *request["sbatch"], request["script"]]
    out = _run(argv, env=submit_env(request.get("env") or {}), timeout=float(request.get("timeout", 120)))
    if out.returncode != 0:
        _write_submit(run_dir, {"job_name": name, "submitting": None, "job_id": None, "error": out.stderr[-2000:]})
        lines = out.stderr.strip().splitlines() or [f"exit {out.returncode}"]
        raise SystemExit(f"obd: sbatch refused the job: {' | '.join(lines[-3:])}")
    job_id = out.stdout.strip().splitlines()[-1].split(";")[0].strip()
    _write_submit(run_dir, {"job_name": name, "submitting": None, "job_id": job_id, "submitted": time.time()})
    return {"job_id": job_id, "reused": False}


# --- probe ---------------------------------------------------------------------------------------


def file_facts(run_dir: str) -> dict:
    """What the run directory says of the job's end: its exit code, obd's cancel files, and why
    Slurm rather than the wrapper's end marker decides the end (`contested`; None: the marker does)."""
    paths = rundir.RunPaths(run_dir)
    code = jobctl.read_int(paths.exit_code)
    return {
        "exit_code": code,
        "cancelled": os.path.lexists(paths.cancelled),
        "cancelling": os.path.lexists(paths.cancelling),
        "contested": contested(read_end_marker(run_dir), code) if code is not None else None,
    }


# Slurm's end states that, after an end marker saying 0, say the job did not end as its command
# did: Slurm's word wins and the run fails with it (COMPLETED and FAILED leave the marker's word).
ENDED_BY_SLURM = frozenset({"TIMEOUT", "CANCELLED", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


def settled(facts: dict) -> dict | None:
    """The job's status from its run directory alone, where that is final: obd's cancel done, or
    an end marker with no sign of Slurm's hand (`contested`); None where Slurm must be asked."""
    code = facts["exit_code"]
    if facts["cancelled"]:
        return {"state": "cancelled", "exit_code": code, "detail": None}
    if code is not None and (facts["cancelling"] or facts.get("contested") is None):
        return {"state": "cancelled" if facts["cancelling"] else "exited", "exit_code": code, "detail": None}
    return None


def combine(facts: dict, job: dict | None, submit_record: dict, now: float) -> dict:
    """The job's status from the run directory (the wrapper's end marker) and Slurm's view of it.

    The marker decides unless it is contested (`contested`): then Slurm's end state does, once
    Slurm ended the job, and a job the marker says exited 0 but Slurm ended for a reason of its
    own (ENDED_BY_SLURM) is `lost` with the command's exit code; a job Slurm no longer knows keeps
    the marker's word. Returns {state, exit_code, detail}; `detail` says what Slurm says (its
    pending reason, its end state), for the daemon's message.
    """
    code = facts["exit_code"]
    known = settled(facts)
    if known is not None:
        return known
    if code is not None:
        state = job["state"] if job is not None else None
        if state in PENDING_STATES or state in ACTIVE_STATES:
            why = facts["contested"]
            return {"state": "running", "exit_code": None, "detail": f"exit {code}, {why}: waiting for Slurm's end"}
        if code == 0 and state in ENDED_BY_SLURM:
            return {"state": "lost", "exit_code": code, "detail": state}
        return {"state": "exited", "exit_code": code, "detail": state}
    if job is None:
        started = submit_record.get("submitting")
        if not submit_record.get("job_id") and isinstance(started, (int, float)) and now - started < SUBMIT_GRACE:
            return {"state": "pending", "exit_code": None, "detail": "being submitted to Slurm"}
        if facts["cancelling"]:
            return {"state": "cancelled", "exit_code": None, "detail": None}
        if submit_record.get("job_id"):
            why = f"Slurm no longer knows job {submit_record['job_id']} and it left no exit code"
        else:
            why = "no Slurm job was submitted for it"
        return {"state": "lost", "exit_code": None, "detail": why}
    state = job["state"]
    if state in PENDING_STATES:
        reason = job["reason"] if job["reason"] not in ("", "None", "(null)") else "submitted, not scheduled yet"
        return {"state": "pending", "exit_code": None, "detail": reason}
    if state in ACTIVE_STATES:
        return {"state": "running", "exit_code": None, "detail": state}
    # Slurm ended it, and the wrapper wrote no exit code: it was killed (time limit, node, memory, scancel).
    if facts["cancelling"] or state == "CANCELLED":
        return {"state": "cancelled", "exit_code": None, "detail": state}
    return {"state": "lost", "exit_code": None, "detail": state}


def slurm_handle(job_id: str | None) -> dict:
    """A run's handle as the daemon records it: the Slurm job id stands where a pid would."""
    number = int(job_id.split("_")[0]) if job_id and job_id.split("_")[0].isdigit() else 0
    return {"pid": number, "start_time": 0, "boot_id": "", "host": f"slurm job {job_id}" if job_id else "slurm"}


def probe_settled(run_dir: str) -> dict | None:
    """One run directory's probe when its files alone settle the job's end (`settled`), with no
    Slurm command: the daemon reads it so where it sees the shared filesystem. None otherwise."""
    status = settled(file_facts(run_dir))
    if status is None:
        return None
    result = jobctl.probe_dir(run_dir, with_job=False)
    result["status"] = status
    job_id = read_submit(run_dir).get("job_id")
    result["handle"] = slurm_handle(job_id) if job_id else None
    return result


def probe(runs: list[dict]) -> dict:
    """One read of many runs: each run directory, and one `squeue` for all their jobs."""
    jobs, error = squeue_by_name(sorted({job_name(r["dir"]) for r in runs}))
    now = time.time()
    out = []
    for run in runs:
        result = jobctl.probe_dir(run["dir"], with_job=False)  # the status and handle come from Slurm below
        record = read_submit(run["dir"])
        job_id = record.get("job_id") or run.get("job_id")
        job = pick_job(jobs.get(job_name(run["dir"]), []), job_id)
        job_id = job_id or (job["job_id"] if job else None)
        facts = file_facts(run["dir"])
        if error is None:
            result["status"] = combine(facts, job, record, now)
        else:  # squeue did not answer: the executor reports the target unreachable
            result.setdefault("status", {"state": "running", "exit_code": None})
        result["handle"] = slurm_handle(job_id) if (job_id or record.get("submitting")) else None
        result["slurm"] = {**(job or {}), "job_id": job_id}
        out.append(result)
    return {"probes": out, "squeue_error": error}


# --- cancel --------------------------------------------------------------------------------------


def _wait_job(job_id: str, seconds: float) -> bool:
    """Wait until Slurm says the job ended (or forgot it); True if it did within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        state = job_state(job_id)
        if state is None or (state not in PENDING_STATES and state not in ACTIVE_STATES and state != "UNKNOWN"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def find_job_id(run_dir: str, name: str, given: str | None, wait: float) -> str | None:
    """The run's job id: recorded, given, or found by name; waits `wait` s for a submit under way."""
    deadline = time.monotonic() + wait
    while True:
        record = read_submit(run_dir)
        if record.get("job_id") or given:
            return record.get("job_id") or given
        found, _ = squeue_by_name([name])
        job = pick_job(found.get(name, []), None)
        if job is not None:
            return job["job_id"]
        started = record.get("submitting")
        under_way = isinstance(started, (int, float)) and time.time() - started < SUBMIT_GRACE
        if not under_way or time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def cancel(run_dir: str, grace: float, job_id: str | None) -> dict:
    """scancel the run's job (Slurm's TERM, then KILL after `grace`) and mark the run cancelled; idempotent."""
    facts = file_facts(run_dir)
    if facts["cancelled"] or (facts["exit_code"] is not None and not facts["cancelling"]):
        return {"state": "cancelled" if facts["cancelled"] else "exited", "exit_code": facts["exit_code"]}
    # Written first: the batch wrapper then takes Slurm's TERM for the cancel it is, not a preemption.
    paths = rundir.RunPaths(run_dir)
    rundir.atomic_write(paths.cancelling, f"{time.time()}\n".encode())
    job_id = find_job_id(run_dir, job_name(run_dir), job_id, wait=min(30.0, SUBMIT_GRACE))
    killed = False
    if job_id is not None:
        out = _run(["scancel", job_id], timeout=60)
        if out.returncode != 0 and "Invalid job id" not in out.stderr and "already completing" not in out.stderr:
            raise SystemExit(f"obd: scancel {job_id} failed: {out.stderr.strip()}")
        if not _wait_job(job_id, grace):
            _run(["scancel", "--full", "--signal=KILL", job_id], timeout=60)
            killed = True
            _wait_job(job_id, 60)
    record = {"time": time.time(), "killed": killed, "job_id": job_id}
    rundir.atomic_write(paths.cancelled, json.dumps(record).encode())
    return {"state": "cancelled", "exit_code": jobctl.read_int(paths.exit_code)}


# --- put ------------------------------------------------------------------------------------------


def put(path: str, data: bytes) -> dict:
    """Write a file whole (its directories made as needed) with this helper's rights: a root
    daemon writes a snapshot request in a user's run directory as the user, so the job reads it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rundir.atomic_write(path, data)
    return {"written": len(data)}


# --- the end marker ---------------------------------------------------------------------------------

END_MARKER = "slurm_end.json"  # the wrapper's last words but one (exit_code is the last): how the job ended
END_MARKER_LIMIT = 4096


def end_marker_path(run_dir: str) -> str:
    return os.path.join(run_dir, END_MARKER)


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer killed in this process's cgroup (and below) so
    far, as Slurm's cgroup plugins count them; None where no memory cgroup can be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            name, where = "oom_kill", f"/sys/fs/cgroup{path}/memory.events"
        elif "memory" in controllers.split(","):  # cgroup v1
            name, where = "oom_kill", f"/sys/fs/cgroup/memory{path}/memory.oom_control"
        else:
            continue
        try:
            with open(where) as f:
                for row in f:
                    key, _, value = row.partition(" ")
                    if key == name and value.strip().isdigit():
                        return int(value)
        except OSError:
            continue
    return None


class EndMarker:
    """The batch wrapper's account of how its job ended, written into the run directory on the
    shared filesystem (`slurm_end.json`, then `exit_code`) the moment the command ends, whatever
    its exit code: the daemon records the run from it without waiting for Slurm. With it go the
    signs that Slurm itself ended or is ending the job (its TERM, an OOM kill in the job's cgroup),
    which leave the final word to Slurm's accounting (`contested`)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.signals: list[str] = []  # Slurm's signals to the batch shell, not obd's cancel
        self.code: int | None = None
        self._oom_before: int | None = None

    def start(self) -> None:
        """Before the command starts: the cgroup's OOM count so far (the job's own kills are counted after it)."""
        self._oom_before = oom_kills()

    def write(self, code: int) -> None:
        self.code = code
        after = oom_kills() if self._oom_before is not None else None
        record = {
            "exit_code": code,
            "time": time.time(),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "slurm_signals": sorted(set(self.signals)),
            "oom_kills": after - self._oom_before if after is not None and self._oom_before is not None else None,
        }
        with contextlib.suppress(OSError):
            rundir.atomic_write(end_marker_path(self.run_dir), json.dumps(record).encode())
        jobctl.write_exit_code(self.run_dir, code)


def read_end_marker(run_dir: str) -> dict | None:
    data = rundir.read_regular(end_marker_path(run_dir), END_MARKER_LIMIT)
    try:
        value = json.loads(data) if data else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def contested(marker: dict | None, code: int) -> str | None:
    """Why Slurm's end state, not the marker, decides how a job whose wrapper wrote `code` ended;
    None when the marker settles it (the command's own end, with no sign of Slurm's hand).

    Slurm's hand: its TERM to the batch shell (the time limit, a preemption, an scancel outside
    obd; its USR1 before the limit is a deadline snapshot's request, which ends cleanly), an OOM
    kill in the job's cgroup, or a command killed by a signal (Slurm's cgroup may have killed it
    for its memory). A bare exit_code with no marker (an older wrapper) settles it, as before.
    """
    if marker is None:
        return None
    if "TERM" in (marker.get("slurm_signals") or []):
        return "Slurm sent the job a TERM"
    kills = marker.get("oom_kills")
    if isinstance(kills, int) and kills > 0:
        return f"the OOM killer killed {kills} process(es) of the job"
    if code > 128:
        return f"its command was killed by signal {code - 128}"
    return None


# --- in the job: the batch wrapper and the per-node launcher -------------------------------------


def request_snapshot(run_dir: str, reason: str) -> None:
    """Write `snapshot.request` unless there is one already (a request's reason is the first asker's)."""
    path = rundir.RunPaths(run_dir).request
    if rundir.read_regular(path, rundir.REQUEST_LIMIT):
        return
    with contextlib.suppress(OSError):
        rundir.atomic_write(path, f"{reason}\n".encode())
        print(f"obd: snapshot requested ({reason}) by a signal from Slurm", file=sys.stderr, flush=True)


def node_address(node: str) -> str:
    """A node's address for the others: its NodeAddr (node names need not resolve), else its name."""
    out = _run(["scontrol", "show", "node", "--oneliner", node], timeout=30)
    for word in out.stdout.split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    return node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_command(spec: dict, plan: dict, env: dict[str, str], run_dir: str) -> list[str]:
    """The argv one node runs: the command as given, or torchrun around it (its logs in the run
    directory, not a `/tmp/torchelastic_*` of the node's left behind)."""
    command = list(spec.get("command") or [])
    if plan.get("launcher") != "torchrun":
        return command
    nodes = int(plan.get("nodes") or 1)
    argv = [plan.get("python") or sys.executable, "-m", "torch.distributed.run"]
    argv.append(f"--nproc-per-node={int(plan.get('nproc_per_node') or 1)}")
    argv.append(f"--log-dir={rundir.RunPaths(run_dir).torchrun_logs(env.get('SLURM_NODEID', '0'))}")
    if nodes == 1:
        argv.append("--standalone")
    else:
        first = env.get("SLURM_NODEID", "0") == "0"
        argv += [
            f"--nnodes={nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={env['OBD_SLURM_RDZV']}",
            f"--rdzv-id=obd-{env.get('SLURM_JOB_ID', 'job')}",
            f"--rdzv-conf=is_host={1 if first else 0}",
        ]
    return [*argv, "--no-python", *command]


def _launch_argv(run_dir: str, spec: dict, plan: dict, env: dict[str, str]) -> list[str]:
    nodes = int(plan.get("nodes") or 1)
    if nodes == 1:
        return node_command(spec, plan, env, run_dir)
    if plan.get("launcher") == "torchrun":
        # The rendezvous is on this node (the first of the job): its address, and a port free here.
        env["OBD_SLURM_RDZV"] = f"{node_address(env.get('SLURMD_NODENAME', socket.gethostname()))}:{free_port()}"
    here = os.path.abspath(__file__)
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        plan.get("python") or sys.executable,
        here,
        "node",
        run_dir,
    ]


def cwd_problem(cwd: str) -> str | None:
    """Why the job cannot work in `cwd` on this node (missing, not a directory, not enterable by the
    job's user), in words that say what to do; None when it can."""
    if not os.path.isdir(cwd):
        why = "it does not exist here"
    elif not os.access(cwd, os.X_OK):
        why = "the job's user may not enter it"
    else:
        return None
    return (
        f"obd: the job's working directory {cwd} cannot be used on node {socket.gethostname()} ({why}): a Slurm "
        "run works in the directory `obd train start` ran in, or in --cwd, which must be on the filesystem the "
        "compute nodes share and open to the job's user; start the run from such a directory (or give --cwd one)"
    )


def batch(run_dir: str) -> int:
    """The job wrapper of a Slurm job: job.pid, the command (on every node), its end marker and
    exit_code; signals become requests. Whatever ends it short of a kill, the marker is written."""
    end = EndMarker(run_dir)
    try:
        return _batch(run_dir, end)
    except BaseException as exc:  # the wrapper's own failure: still a recorded end, never a silent one
        if end.code is None:
            print(f"obd: the job wrapper failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            end.write(1)
        if isinstance(exc, Exception):
            return 1
        raise


def _batch(run_dir: str, end: EndMarker) -> int:
    paths = rundir.RunPaths(run_dir)
    spec = json.loads(rundir.read_regular(paths.job_spec, rundir.JOB_SPEC_LIMIT) or b"{}")
    plan = json.loads(rundir.read_regular(paths.slurm_launch, 65536) or b"{}")
    if spec.get("umask") is not None:
        os.umask(int(spec["umask"]) & 0o777)
    env = jobctl.job_environment(spec, {}, False)
    cwd = spec.get("cwd") or run_dir
    started = time.monotonic()
    limit = plan.get("time_limit")
    child: list[subprocess.Popen] = []
    cancel_seen: list[bool] = []  # obd's cancel TERM, kept for a child not started yet when it came

    def on_usr1(signum: int, frame: object) -> None:
        end.signals.append("USR1")
        request_snapshot(run_dir, rundir.DEADLINE)

    def on_term(signum: int, frame: object) -> None:
        if os.path.lexists(paths.cancelling):
            cancel_seen.append(True)
            for proc in child:  # obd's cancel: the job ends (Slurm signals its steps too)
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGTERM)
            return
        # Slurm's TERM at the time limit, or a preemption's (GraceTime): ask for the snapshot.
        end.signals.append("TERM")
        near_limit = isinstance(limit, (int, float)) and time.monotonic() - started >= limit - 10
        request_snapshot(run_dir, rundir.DEADLINE if near_limit else rundir.PREEMPTED)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    handle = {
        **jobctl.wrapper_handle(spec.get("command") or [], env, cwd),
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    rundir.atomic_write(paths.job_pid, json.dumps(handle).encode())
    end.start()
    if cancel_seen or os.path.lexists(paths.cancelling):
        # obd cancelled the run before its command started (scancel met the job as it began).
        print("obd: the run was cancelled before its command started", file=sys.stderr, flush=True)
        end.write(143)
        return 143
    problem = cwd_problem(cwd)
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        end.write(1)
        return 1
    argv = _launch_argv(run_dir, spec, plan, env)
    try:
        # Left in the batch's process group (no new session): Slurm's process tracking must find
        # and end everything the job starts.
        child.append(subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL))
    except (OSError, ValueError) as exc:
        print(f"obd: could not start {argv[:1]!r}: {exc}", file=sys.stderr, flush=True)
        end.write(127)
        return 127
    if cancel_seen:  # the cancel's TERM came while the command was being started
        with contextlib.suppress(OSError):
            child[0].send_signal(signal.SIGTERM)
    code = jobctl.shell_exit_code(child[0].wait())
    proof = os.path.lexists(paths.proof)
    if code == 0 and spec.get("output_to") and not proof:
        jobctl.place_outputs(run_dir, spec["output_to"], cwd, sys.stderr.fileno())
    end.write(code)
    return min(code, 255)


def node(run_dir: str) -> int:
    """On each node of a multi-node job (under srun): run the node's command in the job's directory."""
    paths = rundir.RunPaths(run_dir)
    spec = json.loads(rundir.read_regular(paths.job_spec, rundir.JOB_SPEC_LIMIT) or b"{}")
    plan = json.loads(rundir.read_regular(paths.slurm_launch, 65536) or b"{}")
    env = dict(os.environ)
    argv = node_command(spec, plan, env, run_dir)
    cwd = spec.get("cwd") or run_dir
    problem = cwd_problem(cwd)
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        return 1
    os.chdir(cwd)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"obd: could not start {argv[:1]!r} on {socket.gethostname()}: {exc}", file=sys.stderr, flush=True)
    return 127


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "submit" and len(argv) >= 2:
        print(json.dumps(submit(argv[1], json.loads(sys.stdin.read() or "{}"))), flush=True)
        return 0
    if command == "probe":
        print(json.dumps(probe(json.loads(sys.stdin.read() or "{}").get("runs", []))), flush=True)
        return 0
    if command == "cancel" and len(argv) >= 2:
        grace = float(_option(argv, "--grace") or 10.0)
        print(json.dumps(cancel(argv[1], grace, _option(argv, "--job-id"))), flush=True)
        return 0
    if command == "put" and len(argv) >= 2:
        print(json.dumps(put(argv[1], sys.stdin.buffer.read())), flush=True)
        return 0
    if command == "batch" and len(argv) >= 2:
        return batch(argv[1])
    if command == "node" and len(argv) >= 2:
        return node(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
