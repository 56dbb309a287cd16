"""The pod watchdog: runs on a Runpod pod beside the job and holds the caps when obd is gone.

Standard library only (plus its sibling jobctl.py and the rundir.py that finds, also standard
library): obd uploads it with them into the run's `plugin/trainer_plugin/tools/` (rundir.py into
the folder above) and starts it detached before the job:

    python3 watchdog.py run --config RUN_DIR/watchdog.json    # no credential given: see "Credentials"
    python3 watchdog.py manifest RUN_DIR [PATH...]             # size and sha256 of the outputs, as JSON
    python3 - manifest RUN_DIR [PATH...] < watchdog.py         # the same, fed on stdin (see `contract_for`)

Every `interval` seconds it looks at the run directory and decides, by these rules:
- `deadline`: writes `snapshot.request` `deadline` once `max_hours` is less than `snapshot_margin`
  away (at most a quarter of the way from the pod's start, so a short cap is not asked at once),
  and cancels the job at `max_hours` (TERM, grace, KILL), unless the daemon holds a fresh lease;
- `cost`: the same for the spend (hourly rate x time since the pod started) against `max_cost_usd`
  (the request is written whatever the lease, the cancel only when the lease is stale);
- `disk`: writes `snapshot.request` `disk` when the workdir's free space falls under
  `disk_min_free_gb` or its use goes over `disk_max_used_pct`;
- `abandoned`: deletes its own pod through the Runpod API when the job ended `abandon_grace` ago and
  no one wrote `retrieved`, and the lease is stale;
- `never_started`: deletes its own pod when no job appeared within `boot_grace` of the watchdog's
  start and the lease is stale.
An existing request is never overwritten. `retrieved` (written by obd once the outputs are safe)
ends the watchdog. The lease is `RUN_DIR/lease`: the unix time (seconds) until which the daemon
is in charge; a lease whose file is older than `lease_max_ttl` counts as stale whatever it says,
so a daemon clock far ahead cannot hold the watchdog off for good. Every decision is one JSON line
in `RUN_DIR/watchdog.log`.

Credentials: none from obd. The job runs as root in the same container, so whatever the watchdog
could read the job could read too; the account's API key therefore never comes to the pod. To end
its own pod the watchdog uses the key Runpod gives every pod, `RUNPOD_API_KEY` "limited in scope to
only the pod" (Runpod's pod environment variables), read when needed from the container's
environment (`container_environ`, PID 1's `/proc/1/environ`; failing that, its own environment).
It asks for `podTerminate`; should the pod's key be refused that, it asks for `podStop` (Runpod
documents stopping a pod from inside it with that key), which ends the GPU's billing and keeps the
volume. Anything the job can do with that key concerns its own pod only.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import stat
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

try:  # imported as trainer_plugin.tools.watchdog
    from .. import rundir
    from . import jobctl
except ImportError:
    try:  # run by path beside jobctl.py, which finds rundir.py (beside it, or in the folder above)
        import jobctl  # type: ignore[no-redef, import-not-found]

        rundir = jobctl.rundir
    except ImportError:  # fed on stdin, or copied without rundir.py beside it: main() calls import_tools
        jobctl = None  # type: ignore[assignment]
        rundir = None  # type: ignore[assignment]

DEFAULTS: dict[str, Any] = {
    "run_dir": None,
    "pod_id": None,
    "started_at": None,  # unix time the pod was created (billing starts)
    "cost_per_hr": None,
    "max_hours": None,
    "max_cost_usd": None,
    "disk_path": None,  # default: run_dir
    "disk_min_free_gb": None,
    "disk_max_used_pct": None,
    "boot_grace": 600.0,
    "abandon_grace": 1800.0,
    "snapshot_margin": 900.0,  # how long ahead of a cap the snapshot is asked for
    "kill_grace": 30.0,
    "interval": 30.0,
    "lease_max_ttl": 3600.0,
    "api_base_url": None,  # default: RUNPOD_API_BASE_URL, else https://api.runpod.io
    "container_environ": "/proc/1/environ",  # the pod's own environment, as Runpod gave it to the container
}
# How much of the container's environment is read (Runpod allows 50 variables of a pod).
ENVIRON_LIMIT = 1 << 20


def load_config(path: str) -> dict[str, Any]:
    """The watchdog's settings: DEFAULTS overlaid with the JSON file obd wrote."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or not raw.get("run_dir"):
        raise ValueError(f"{path}: not a watchdog config (no run_dir)")
    cfg = dict(DEFAULTS)
    cfg.update({k: v for k, v in raw.items() if k in DEFAULTS})
    return cfg


def read_lease(run_dir: str) -> tuple[float | None, float | None]:
    """(expiry written by the daemon, file mtime), or (None, None) when there is no lease."""
    path = rundir.RunPaths(run_dir).lease
    data = rundir.read_regular(path, 64)
    if not data:
        return None, None
    try:
        expiry = float(data.strip())
        mtime = os.stat(path).st_mtime
    except (ValueError, OSError):
        return None, None
    return expiry, mtime


def read_environ(path: str) -> dict[str, str]:
    """The variables of an environ file (NUL-separated `NAME=value`, as /proc/PID/environ); {} when
    it cannot be read. Never follows a link at the end of `path`, never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        data = os.read(fd, ENVIRON_LIMIT)
    except OSError:
        return {}
    finally:
        os.close(fd)
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            out[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


class Refused(RuntimeError):
    """The API refused the key for this call (401/403, or an `Unauthorized` GraphQL error)."""


class NoPodKey(RuntimeError):
    """The pod's own key is nowhere to be read: the watchdog cannot end its pod."""


def pod_mutation(base_url: str, api_key: str, field: str, pod_id: str, timeout: float = 30.0) -> None:
    """Send `podTerminate` or `podStop` for `pod_id` as the runpod SDK writes them; raises on failure
    (`Refused` when the key may not do it). A pod that is already gone counts as done."""
    if not pod_id.isalnum():
        raise ValueError(f"bad pod id {pod_id!r}")
    selection = "" if field == "podTerminate" else " { id desiredStatus }"
    query = f'mutation {{ {field}(input: {{ podId: "{pod_id}" }}){selection} }}'
    req = urllib.request.Request(
        base_url.rstrip("/") + "/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {api_key}",
            "User-Agent": "obd-watchdog",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise Refused(f"HTTP {exc.code}") from None
        raise RuntimeError(f"HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"API unreachable: {getattr(exc, 'reason', exc)}") from None
    try:
        answer = json.loads(body)
    except ValueError:
        raise RuntimeError("the API answered with something that is not JSON") from None
    errors = answer.get("errors") if isinstance(answer, dict) else None
    if errors:
        message = str(errors[0].get("message", errors[0])) if isinstance(errors, list) and errors else str(errors)
        lowered = message.lower()
        if "not found" in lowered:
            return  # already gone
        if "unauthori" in lowered or "forbidden" in lowered or "permission" in lowered:
            raise Refused(message[:300])
        raise RuntimeError(message[:300])


def delete_pod_http(base_url: str, api_key: str, pod_id: str, timeout: float = 30.0) -> None:
    """Terminate the pod with the GraphQL mutation the runpod SDK sends; raises on failure."""
    pod_mutation(base_url, api_key, "podTerminate", pod_id, timeout)


def end_pod_http(base_url: str, api_key: str, pod_id: str, timeout: float = 30.0) -> str:
    """End the pod with its own key: terminated, or, where the key may not terminate it, stopped
    (GPU billing ends, the volume stays). Returns how: "terminated" or "stopped"."""
    try:
        pod_mutation(base_url, api_key, "podTerminate", pod_id, timeout)
        return "terminated"
    except Refused:
        pod_mutation(base_url, api_key, "podStop", pod_id, timeout)
        return "stopped"


class Watchdog:
    """The rules above as one `step()`; the clock, disk probe, pod deletion and cancel are injectable."""

    def __init__(
        self,
        cfg: dict[str, Any],
        *,
        clock: Callable[[], float] = time.time,
        statvfs: Callable[[str], Any] = os.statvfs,
        delete_pod: Callable[[str], str | None] | None = None,
        cancel_job: Callable[[str, float], Any] | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.cfg = {**DEFAULTS, **cfg}
        self.run_dir: str = self.cfg["run_dir"]
        self.paths = rundir.RunPaths(self.run_dir)
        self.clock = clock
        self.statvfs = statvfs
        self.environ = dict(os.environ if environ is None else environ)
        self.pod_id = self.cfg["pod_id"] or self.environ.get("RUNPOD_POD_ID") or ""
        self.base_url = self.cfg["api_base_url"] or self.environ.get("RUNPOD_API_BASE_URL") or "https://api.runpod.io"
        self._delete = delete_pod or self._end_own_pod
        self._cancel = cancel_job or jobctl.cancel
        self.started = clock()
        self.lost_since: float | None = None
        self.said: set[tuple[str, str]] = set()
        self.deleted = False

    # --- its one credential ---------------------------------------------------------------------

    def pod_key(self) -> str:
        """The pod's own key, which Runpod scopes to this pod: from the container's environment
        (PID 1's, where Runpod put it), else from this process's own; "" when there is none."""
        container = read_environ(str(self.cfg["container_environ"] or ""))
        return (container.get("RUNPOD_API_KEY") or self.environ.get("RUNPOD_API_KEY") or "").strip()

    def _end_own_pod(self, pod_id: str) -> str:
        """Terminate (or, where its key may only stop it, stop) this pod with the pod's own key."""
        key = self.pod_key()
        if not key:
            raise NoPodKey(
                f"no pod-scoped RUNPOD_API_KEY in the container's environment ({self.cfg['container_environ']}) "
                "nor in the watchdog's; the daemon ends the pod when it is back (`obd pods rm POD` by hand)"
            )
        return end_pod_http(self.base_url, key, pod_id)

    # --- observations -------------------------------------------------------------------------

    def job_phase(self, now: float) -> tuple[str, float | None]:
        """('waiting' | 'running' | 'ended', when it ended) from the files the job wrapper writes."""
        for path in (self.paths.cancelled, self.paths.exit_code):
            try:
                return "ended", os.stat(path).st_mtime
            except OSError:
                pass
        if not os.path.exists(self.paths.job_pid):
            return "waiting", None
        status = jobctl.job_status(self.run_dir)
        if status["state"] == "running":
            self.lost_since = None
            return "running", None
        if status["state"] in ("exited", "cancelled"):
            return "ended", now
        # lost: the wrapper died without an exit code (OOM killer, container restart)
        if self.lost_since is None:
            self.lost_since = now
        return "ended", self.lost_since

    def lease_fresh(self, now: float) -> bool:
        expiry, mtime = read_lease(self.run_dir)
        if expiry is None or mtime is None:
            return False
        return now < expiry and now < mtime + float(self.cfg["lease_max_ttl"])

    def disk_reason(self) -> dict[str, Any] | None:
        """The disk figures when the policy says snapshot, else None."""
        min_free, max_used = self.cfg["disk_min_free_gb"], self.cfg["disk_max_used_pct"]
        if min_free is None and max_used is None:
            return None
        try:
            st = self.statvfs(self.cfg["disk_path"] or self.run_dir)
        except OSError as exc:
            self.say("disk_unreadable", rundir.DISK, error=str(exc))
            return None
        free_gb = st.f_bavail * st.f_frsize / 1e9
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        usable = used + st.f_bavail * st.f_frsize
        used_pct = 100.0 * used / usable if usable else 0.0
        if (min_free is not None and free_gb < float(min_free)) or (
            max_used is not None and used_pct > float(max_used)
        ):
            return {"free_gb": round(free_gb, 3), "used_pct": round(used_pct, 2)}
        return None

    # --- decisions ----------------------------------------------------------------------------

    def say(self, event: str, reason: str = "", once: bool = True, **fields: Any) -> None:
        """Append a decision to watchdog.log (each event/reason pair once, unless once=False)."""
        if once and (event, reason) in self.said:
            return
        self.said.add((event, reason))
        line = {"time": self.clock(), "event": event, "reason": reason, **fields}
        try:
            fd = os.open(self.paths.watchdog_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    def request(self, reason: str, **fields: Any) -> None:
        """Write `snapshot.request` with `reason`, atomically, unless a request is already there."""
        existing = rundir.read_regular(self.paths.request, rundir.REQUEST_LIMIT)
        if existing and existing.strip():
            self.say("request_exists", reason, existing=existing.decode("utf-8", "replace").strip(), **fields)
            return
        rundir.atomic_write(self.paths.request, rundir.request_bytes(reason))
        self.say("snapshot_requested", reason, **fields)

    def hard_stop(self, reason: str, **fields: Any) -> None:
        """Cancel the job at a cap the daemon is not there to enforce."""
        if ("job_cancelled", reason) in self.said:
            return
        self.say("cancelling_job", reason, **fields)
        try:
            self._cancel(self.run_dir, float(self.cfg["kill_grace"]))
        except Exception as exc:  # the next step tries again
            self.said.discard(("cancelling_job", reason))
            self.say("cancel_failed", reason, once=False, error=f"{type(exc).__name__}: {exc}")
            return
        self.say("job_cancelled", reason)

    def delete(self, reason: str, **fields: Any) -> bool:
        """End the pod (terminated, or stopped where its key may only stop it); True once the API
        confirmed it. A failure is logged and tried again at the next step."""
        if not self.pod_id:
            self.say("cannot_delete_pod", reason, why="no pod id", **fields)
            return False
        self.say("deleting_pod", reason, pod_id=self.pod_id, **fields)
        try:
            how = self._delete(self.pod_id) or "terminated"
        except NoPodKey as exc:
            self.say("cannot_delete_pod", reason, why=str(exc))
            return False
        except Exception as exc:
            self.say("delete_failed", reason, once=False, error=str(exc)[:300])
            return False
        self.say("pod_deleted" if how == "terminated" else "pod_stopped", reason, pod_id=self.pod_id)
        self.deleted = True
        return True

    def step(self) -> bool:
        """Look once and act; True when the watchdog's work is over (retrieved, or pod deleted)."""
        now = self.clock()
        if os.path.exists(self.paths.retrieved):
            self.say("retrieved", "", detail="obd retrieved the outputs; the watchdog stops")
            return True
        fresh = self.lease_fresh(now)
        phase, ended_at = self.job_phase(now)
        if phase == "waiting":
            if now - self.started >= float(self.cfg["boot_grace"]):
                if fresh:
                    self.held_by_lease("never_started")
                    return False
                return self.delete("never_started", waited=round(now - self.started, 1))
            return False
        if phase == "ended":
            assert ended_at is not None
            idle = now - ended_at
            if idle >= float(self.cfg["abandon_grace"]):
                if fresh:
                    self.held_by_lease("abandoned")
                    return False
                return self.delete("abandoned", ended_ago=round(idle, 1))
            return False
        self.check_caps(now, fresh)
        return False

    def held_by_lease(self, reason: str) -> None:
        """Log, once per reason, a decision left to the daemon because it holds a fresh lease."""
        expiry, _ = read_lease(self.run_dir)
        self.say("left_to_the_daemon", reason, lease_until=expiry)

    def margin(self, span: float) -> float:
        """How long ahead of a cap to ask: `snapshot_margin`, at most a quarter of the span to it."""
        return max(0.0, min(float(self.cfg["snapshot_margin"]), span / 4.0))

    def check_caps(self, now: float, fresh: bool) -> None:
        cfg = self.cfg
        started_at = cfg["started_at"]
        if cfg["max_hours"] is not None and started_at is not None:
            deadline = float(started_at) + float(cfg["max_hours"]) * 3600.0
            if now >= deadline - self.margin(deadline - float(started_at)):
                if fresh:
                    self.held_by_lease(rundir.DEADLINE)
                else:
                    self.request(rundir.DEADLINE, deadline=deadline)
            if not fresh and now >= deadline:
                self.hard_stop(rundir.DEADLINE, deadline=deadline)
        rate = cfg["cost_per_hr"]
        if cfg["max_cost_usd"] is not None and started_at is not None and rate:
            cap_at = float(started_at) + float(cfg["max_cost_usd"]) / float(rate) * 3600.0
            spend = round(float(rate) * (now - float(started_at)) / 3600.0, 4)
            if now >= cap_at - self.margin(cap_at - float(started_at)):
                self.request(rundir.COST, spend_usd=spend, max_cost_usd=cfg["max_cost_usd"])
            if now >= cap_at:
                if fresh:
                    self.held_by_lease(rundir.COST)
                else:
                    self.hard_stop(rundir.COST, spend_usd=spend)
        disk = self.disk_reason()
        if disk is not None:
            self.request(rundir.DISK, **disk)

    def run(self, sleep: Callable[[float], None] = time.sleep, max_steps: int | None = None) -> int:
        """Step every `interval` seconds until done; at most one watchdog per run directory."""
        lock = _lock(self.paths.watchdog_lock)
        if lock is None:
            self.say("already_running", "")
            return 0
        self.say(
            "start",
            "",
            pod_id=self.pod_id,
            pid=os.getpid(),
            **{
                k: self.cfg[k]
                for k in ("max_hours", "max_cost_usd", "cost_per_hr", "started_at", "boot_grace", "abandon_grace")
            },
        )
        steps = 0
        while max_steps is None or steps < max_steps:
            steps += 1
            try:
                if self.step():
                    return 0
            except Exception as exc:  # never die on a transient error: a dead watchdog guards nothing
                self.say("error", "", once=False, error=f"{type(exc).__name__}: {exc}"[:300])
            sleep(float(self.cfg["interval"]))
        return 0


def _lock(path: str) -> int | None:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd  # held for the life of the process


# --- the output manifest (for obd's verified retrieval) -----------------------------------------


def sha256_file(path: str) -> tuple[int, str]:
    """(size, sha256 hex) of a regular file, read without following a link."""
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return size, digest.hexdigest()


def manifest(run_dir: str, names: tuple[str, ...] | list[str] | None = None) -> dict[str, Any]:
    """Every regular file under `names` (default: what obd retrieves) in the run directory with its size and sha256.

    Links, FIFOs and devices are skipped (listed under `skipped`), so nothing outside the run
    directory is ever read or named.
    """
    files: list[dict[str, Any]] = []
    skipped: list[str] = []
    missing: list[str] = []
    for name in rundir.OUTPUTS if names is None else names:
        if name.startswith("/") or ".." in name.split("/"):
            skipped.append(name)
            continue
        top = os.path.join(run_dir, name)
        try:
            st = os.lstat(top)
        except OSError:
            missing.append(name)
            continue
        if stat.S_ISREG(st.st_mode):
            size, digest = sha256_file(top)
            files.append({"path": name, "size": size, "sha256": digest})
        elif stat.S_ISDIR(st.st_mode):
            for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
                dirnames.sort()
                for entry in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                    full = os.path.join(dirpath, entry)
                    rel = os.path.relpath(full, run_dir)
                    try:
                        est = os.lstat(full)
                    except OSError:
                        continue
                    if not stat.S_ISREG(est.st_mode):
                        skipped.append(rel)
                        continue
                    size, digest = sha256_file(full)
                    files.append({"path": rel, "size": size, "sha256": digest})
        else:
            skipped.append(name)
    return {"run_dir": run_dir, "files": files, "skipped": skipped, "missing": missing}


def _tool_dirs(run_dir: str) -> list[str]:
    """Directories that may hold jobctl.py with its rundir.py (beside it, or in the folder above),
    for `run_dir`: the run's plugin copy (`plugin/trainer_plugin/tools/`), the same copy as the
    previous release laid it out (flat in `plugin/trainer_plugin/`: a pod started before the
    tools had a folder of their own), then obd's tools directories of its workdir, newest first.

    These folder names are spelt here, not taken from rundir.py, because they are how to find it.
    """
    workdir = os.path.dirname(os.path.abspath(run_dir))
    tools = glob.glob(os.path.join(workdir, ".obd", "tools-*"))
    tools.sort(key=lambda d: os.stat(d).st_mtime if os.path.isdir(d) else 0.0, reverse=True)
    package = os.path.join(run_dir, "plugin", "trainer_plugin")
    return [os.path.join(package, "tools"), package, *tools]


def _has_rundir(directory: str) -> bool:
    """Whether jobctl.py in `directory` finds a rundir.py: beside it, or in the folder above."""
    return any(os.path.isfile(os.path.join(d, "rundir.py")) for d in (directory, os.path.dirname(directory)))


def import_tools(run_dir: str, like: bytes | None = None) -> None:
    """Import jobctl (and the rundir it imports) for a watchdog with no rundir.py beside it.

    Fed on stdin (`python3 - manifest RUN_DIR`), the watchdog has nothing beside it; copied into
    the run's plugin/ before the rest of the plugin, it may have jobctl.py without rundir.py. obd
    installs both into every SSH host's and pod's `<workdir>/.obd/tools-<hash>/` when it connects,
    and into the run's plugin/. `like`: the bytes of a jobctl.py whose very version is wanted.
    """
    global jobctl, rundir
    for directory in _tool_dirs(run_dir):
        try:
            with open(os.path.join(directory, "jobctl.py"), "rb") as f:
                source = f.read()
        except OSError:
            continue
        if (like is not None and source != like) or not _has_rundir(directory):
            continue
        sys.path.insert(0, directory)
        import jobctl as found

        jobctl, rundir = found, found.rundir
        return
    raise ImportError(f"no jobctl.py with its rundir.py in {', '.join(_tool_dirs(run_dir))}")


def _sibling_jobctl() -> bytes | None:
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobctl.py"), "rb") as f:
            return f.read()
    except (OSError, NameError):  # NameError: fed on stdin, there is no __file__
        return None


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "manifest":
        if rundir is None and not argv[2:]:  # the default paths are the contract's OUTPUTS
            try:
                import_tools(argv[1])
            except (ImportError, SyntaxError) as exc:
                print(f"obd watchdog: cannot list the outputs of {argv[1]}: {exc}", file=sys.stderr)
                return 2
        print(json.dumps(manifest(argv[1], argv[2:] or None)), flush=True)
        return 0
    if len(argv) >= 3 and argv[0] == "run" and argv[1] == "--config":
        cfg = load_config(argv[2])
        if rundir is None:
            import_tools(cfg["run_dir"], like=_sibling_jobctl())
        return Watchdog(cfg).run()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
