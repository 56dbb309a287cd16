"""The job wrapper: starts a run's job detached, and supervises it to its end (standard library only).

`python3 supervisor.py start RUN_DIR [--secrets-stdin | --spec-stdin] [--clean-env] [--facts DIR]`
(run by path, beside jobctl.py) forks the wrapper and prints its handle, which the wrapper sends back
through a pipe (a file in the run directory is never read back for it). The wrapper leads a
session and process group of its own for the job's lifetime, and is the one source of how the
job ended, as Slurm's slurmstepd is:

- Under a root daemon the wrapper stays root and only the job runs as its user (groups, gid,
  uid dropped in the child before exec), so the job can neither signal the wrapper nor write
  where it records the job's handle and end: the facts directory (`--facts DIR`), the daemon's
  own. A planted `job.pid`, `exit_code` or `cancelled` in the run directory changes nothing.
  What the wrapper does in the run directory (the log, `job.pid`, `exit_code` for people to
  read) it does with the user's filesystem rights (`creds.acting_as`).
- It is a child subreaper: a process of the job that leaves the group or double-forks stays
  its descendant, and is ended before the end is recorded. With `cgroup` in its spec (a local
  run where the daemon made one, executors/containment.py) the job is moved into the run's
  cgroup before it runs anything, and every process there (the run's exec sessions' too) is
  ended; with `run_id`, so is every process of the job's user started with the run's
  `OBD_RUN_ID` (trainer_plugin/tools/contain.py). A GPU is free only once every process of the run
  is gone.
- The job's command, environment and account come on stdin (`--spec-stdin`) from a root
  daemon, never from `job.json`, a file the user could rewrite before the wrapper reads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from typing import Any

try:  # imported as trainer_plugin.tools.supervisor
    from .. import rundir
    from . import contain, creds, jobctl
except ImportError:  # run by path (`python3 supervisor.py start ...`) beside jobctl.py, which finds rundir.py
    import contain  # type: ignore[no-redef, import-not-found]
    import creds  # type: ignore[no-redef, import-not-found]
    import jobctl  # type: ignore[no-redef, import-not-found]

    rundir = jobctl.rundir

PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE = 5.0  # TERM to KILL for what the job left behind
GONE_WAIT = 30.0  # after KILL, how long the wrapper waits for the last process before it records the end


def start(
    run_dir: str, spec: dict[str, Any], values: dict[str, str], clean_env: bool = False, facts: str | None = None
) -> dict[str, Any]:
    """Start the job of `spec` detached, in its own session; return the wrapper's handle.

    `spec` holds `command` (argv), `cwd`, `pythonpath`, `path_prepend`, `env`, `umask`,
    `output_to` and, for a job that runs as another user than this process, `run_as` (`uid`,
    `gid`, `groups`, `user`, `home`). `values` are variables added to the job's environment
    (with `clean_env`, its whole environment); they are never written anywhere.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the wrapper
        os.close(read_end)
        try:
            code = _supervise(run_dir, spec, values, clean_env, facts, write_end)
        except BaseException:  # never return into the caller's stack from a fork
            code = 70
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()  # the handle, then EOF once the job's command is started
    try:
        handle = json.loads(data)
    except ValueError:
        handle = None
    if not isinstance(handle, dict):
        raise SystemExit(f"obd: the job wrapper did not start; see {rundir.RunPaths(run_dir).job_log}")
    return handle


def _owner(spec: dict[str, Any]) -> creds.Account | None:
    run_as = spec.get("run_as")
    if not run_as:
        return None
    return creds.account(int(run_as["uid"]), int(run_as["gid"]), [int(g) for g in run_as.get("groups") or []])


def _supervise(
    run_dir: str, spec: dict[str, Any], values: dict[str, str], clean_env: bool, facts: str | None, ready_fd: int
) -> int:
    os.setsid()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # TERM reaches the whole group; the wrapper outlives its job to record how it ended.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _become_subreaper()
    owner = _owner(spec)
    me = os.getpid()
    handle: dict[str, Any] = {"pid": me, "start_time": jobctl.process_start_time(me), "boot_id": jobctl.boot_id()}
    handle["uid"] = int(spec["run_as"]["uid"]) if spec.get("run_as") else os.getuid()
    # The run's containment, kept in the facts (the daemon's own) for a cancel: never read back
    # from the run directory's job.pid, which its user may rewrite.
    handle.update(cgroup=spec.get("cgroup"), run_id=spec.get("run_id"))
    paths = rundir.RunPaths(run_dir)
    fact_paths = rundir.FactPaths(facts) if facts else None
    if fact_paths:  # written before anything starts: a daemon restarted meanwhile finds the wrapper here
        rundir.atomic_write(fact_paths.handle, json.dumps(handle).encode(), 0o600)
    with creds.acting_as(owner):
        log = os.open(
            paths.job_log,
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
    # Let go of the caller's pipes (its reader waits for their end), and say anything into the log.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    env = jobctl.job_environment(spec, values, clean_env)
    command: list[str] = spec.get("command") or []
    cwd = spec.get("cwd") or run_dir
    info_read, info_write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(info_read)
        _exec_job(spec, command, env, cwd, log, info_write)
    os.close(info_write)
    with os.fdopen(info_read, "rb") as pipe:
        info = _json_object(pipe.read())
    handle.update(cwd=cwd, executable=info.get("executable"), python=info.get("python"))
    if fact_paths:
        rundir.atomic_write(fact_paths.handle, json.dumps(handle).encode(), 0o600)
    with creds.acting_as(owner), contextlib.suppress(OSError):  # for people to read; never trusted
        rundir.atomic_write(paths.job_pid, json.dumps(handle).encode())
    os.write(ready_fd, json.dumps(handle).encode())
    os.close(ready_fd)
    code = jobctl.shell_exit_code(_exit_code(os.waitpid(child, 0)[1]))
    if code == 0 and spec.get("output_to"):
        _place_outputs(run_dir, spec, cwd, log)
    _end_leftovers(me, log, spec, handle["uid"])
    if fact_paths:
        rundir.atomic_write(fact_paths.exit_code, f"{code}\n".encode(), 0o600)
    with creds.acting_as(owner), contextlib.suppress(OSError):
        jobctl.write_exit_code(run_dir, code)
    return 0


def _exec_job(spec: dict[str, Any], command: list[str], env: dict[str, str], cwd: str, log: int, info_fd: int) -> None:
    """In the forked child: become the job's user for good, then exec the command (never returns).

    Everything the job touches from here is done with its user's rights: its working directory,
    the lookup of its program, the program itself."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for name in ("SIGPIPE", "SIGXFSZ"):  # as subprocess's restore_signals does
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        if spec.get("cgroup"):  # still root: into the run's cgroup before anything of the job runs
            try:
                contain.join(spec["cgroup"])
            except OSError as exc:
                os.write(
                    log,
                    f"obd: the job is not in the run's cgroup ({exc}); its processes are found by OBD_RUN_ID\n".encode(),
                )
        if spec.get("run_as"):
            jobctl.become(spec["run_as"])
        if spec.get("umask") is not None:
            os.umask(int(spec["umask"]) & 0o777)
        os.chdir(cwd)
        info = {
            "executable": jobctl.which(command[0], env, cwd) if command else None,
            "python": jobctl.env_python(env, cwd),
        }
        os.write(info_fd, json.dumps(info).encode())  # the pipe closes at exec (close-on-exec)
        os.execvpe(command[0], command, env)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(log, f"obd: could not start {command[:1]!r}: {exc}\n".encode())
    os._exit(127)


def _place_outputs(run_dir: str, spec: dict[str, Any], cwd: str, log: int) -> None:
    """`--output-to`, done in a child that is the job's user (the wrapper may be root)."""
    if os.path.lexists(rundir.RunPaths(run_dir).proof):
        return  # a stopped run's partial save is never placed as its final output
    pid = os.fork()
    if pid == 0:
        try:
            if spec.get("run_as"):
                jobctl.become(spec["run_as"])
            jobctl.place_outputs(run_dir, spec["output_to"], cwd, log)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _end_leftovers(me: int, log: int, spec: dict[str, Any], uid: int) -> None:
    """End what the run left behind (stray workers holding a GPU, daemonized children, exec
    sessions): TERM, a grace, then KILL; reap everything that comes back to the wrapper, and
    return only once none is left (or after GONE_WAIT past the KILL, saying so in the log). The
    run's cgroup is removed once empty; an exec session that joined it meanwhile is ended too."""
    cgroup, run_id = spec.get("cgroup"), spec.get("run_id")
    left = jobctl.job_processes(me) | contain.members(cgroup, run_id, uid)
    if left:  # said before the exit status, so the run's record says it (a GPU may be held)
        pids = " ".join(str(p) for p in sorted(left)[:10])
        os.write(log, f"{jobctl.LEFT_BEHIND} {len(left)} processes in its group (pids {pids}); ending them\n".encode())
    for _ in range(3):
        for sig, wait in ((signal.SIGTERM, LEFTOVER_GRACE), (signal.SIGKILL, GONE_WAIT)):
            if not left:
                break
            jobctl.signal_job(me, sig)
            contain.signal_all(cgroup, run_id, uid, sig)
            deadline = time.monotonic() + wait
            while left and time.monotonic() < deadline:
                _reap()
                time.sleep(0.05)
                left = jobctl.job_processes(me) | contain.members(cgroup, run_id, uid)
        _reap()
        if left or contain.remove(cgroup):
            break
        left = contain.members(cgroup, run_id, uid)  # one joined after the last look: once more
    if left:
        os.write(log, f"obd: {len(left)} processes of the job could not be ended (pids {sorted(left)[:10]})\n".encode())


def _exit_code(status: int) -> int:
    """A wait status as subprocess reports it: the exit code, or minus the signal (3.8 has no waitstatus_to_exitcode)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _reap() -> None:
    """Collect the exit of every child that ended (orphans of the job come back to a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _become_subreaper() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def read_start_input(run_dir: str, argv: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The job's spec and values, as `supervisor.py start` was given them: both on stdin
    (`--spec-stdin`, a root daemon's way), or job.json and the values on stdin (`--secrets-stdin`)."""
    if "--spec-stdin" in argv:
        payload = _json_object(sys.stdin.buffer.read())
        spec = payload.get("spec")
        if not isinstance(spec, dict) or not spec.get("command"):
            # Cut short (the daemon went away while it was sending): nothing is started.
            raise SystemExit("obd: the job wrapper got no job on its stdin; nothing was started")
        return spec, payload.get("values") or {}
    spec = _json_object(rundir.read_regular(rundir.RunPaths(run_dir).job_spec, rundir.JOB_SPEC_LIMIT) or b"{}")
    values = _json_object(sys.stdin.buffer.read()) if "--secrets-stdin" in argv else {}
    return spec, values


def main(argv: list[str]) -> int:
    """`start RUN_DIR [--secrets-stdin | --spec-stdin] [--clean-env] [--facts DIR]`: start the
    job under the wrapper, and print its handle (one JSON line) once it runs."""
    if len(argv) < 2 or argv[0] != "start":
        print(__doc__, file=sys.stderr)
        return 2
    spec, values = read_start_input(argv[1], argv)
    facts = argv[argv.index("--facts") + 1] if "--facts" in argv else None
    started = start(argv[1], spec, values, clean_env="--clean-env" in argv, facts=facts)
    print(json.dumps(started), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
