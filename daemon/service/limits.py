"""A chain's limits (docs/limits.md): its time limit, its deadline, its GPU-hour and cost budgets.

`obd train start --time-limit/--deadline/--max-gpu-hours/--max-cost-usd` put them in the run's
record (`RunRecord.limits`), and every next attempt of its chain (a retry, the way back from a
preemption) gets them with what the attempts before it used (`carried`, called by the launch's
`next_attempt`), so they hold across retries, pauses and restarts of the daemon: nothing of them
lives only in memory.

The follow asks `check` on every poll of a running attempt. When a limit is closer than the time
the run needs to stop (`lead`: its last measured save on the chain, a snapshot's request to its
proof or a periodic save the plugin timed, never less than `[limits] save_floor`, plus `[limits] margin`; at most half the limit, so a
short one still trains), obd asks for a `deadline` (time limit, deadline) or `cost` (GPU-hours,
cost) snapshot through daemon/service/stop.py, as any stop: the run ends `stopped` with a checkpoint, and a
job that never snapshots meets the stop fallback. A run whose scheduler ends jobs on time (Slurm)
is also given what its time limit and deadline leave it (`job_time`), so the scheduler signals for
the snapshot itself; the daemon's own check stays as the safety net.

The functions down to `check` are pure (records, numbers and the clock in, a decision out) and
table-tested in tests/daemon/test_limits.py; the few at the end read the config and the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from daemon.service.api import ApiError, StartRequest
from daemon.service.models import Limits, RunRecord, RunState, Transition
from daemon.service.ports import Runs
from executors.base import SaveLine
from executors.config import AnyTarget
from executors.factory import gpus_counted, has_price, makes_pods, run_price
from trainer_plugin.rundir import COST, DEADLINE

# A `deadline` request that the job's scheduler made (Slurm's --signal, which Slurm may send up to
# a minute early, its time limit counted in whole minutes) this close to a time limit or deadline
# is that limit's: the run stopped at its time limit even when obd's own check had not asked yet.
SCHEDULER_SLACK = 90.0

TIME_LIMIT, DEADLINE_LIMIT, GPU_BUDGET, COST_BUDGET = "time limit", "deadline", "GPU-hour budget", "cost budget"


@dataclass(frozen=True)
class Rate:
    """What an attempt counts while it runs: its GPUs, what an hour of it costs, and what its own
    machine (a pod) had cost so far (None: it is priced by its running time)."""

    gpus: int = 0
    usd_per_hour: float | None = None
    spent_usd: float | None = None


@dataclass(frozen=True)
class Use:
    """Running wall time, GPU-seconds and dollars: of one attempt, or summed over a chain."""

    run_seconds: float = 0.0
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0

    def __add__(self, other: Use) -> Use:
        return Use(
            self.run_seconds + other.run_seconds,
            self.gpu_seconds + other.gpu_seconds,
            self.cost_usd + other.cost_usd,
        )


@dataclass(frozen=True)
class Left:
    """How much of one limit is left: in wall seconds at the attempt's rate (what the lead is
    measured against), and how long the whole limit lasts at that rate (its span)."""

    limit: str  # TIME_LIMIT, DEADLINE_LIMIT, GPU_BUDGET or COST_BUDGET
    reason: str  # the snapshot's reason word: `deadline` or `cost`
    seconds: float
    span: float


# --- what an attempt and a chain used -----------------------------------------------------------


def running_seconds(history: Sequence[Transition], now: float) -> float:
    """Wall seconds the run spent `running` (never queued, paused or pending in a scheduler), up to
    its end, or to `now` while it runs. Notes in the history carry the state they were made in."""
    total, since = 0.0, None
    for entry in history:
        running = entry.state == RunState.running
        if running and since is None:
            since = entry.time
        elif not running and since is not None:
            total += max(0.0, entry.time - since)
            since = None
    if since is not None:
        total += max(0.0, now - since)
    return total


def attempt_use(record: RunRecord, rate: Rate, now: float) -> Use:
    """What one attempt used: its running time, × its GPUs, and its cost (its machine's spend where
    it has one of its own, else its running hours × its price)."""
    seconds = running_seconds(record.history, now)
    cost = rate.spent_usd if rate.spent_usd is not None else seconds * (rate.usd_per_hour or 0.0) / 3600.0
    return Use(seconds, seconds * rate.gpus, cost)


def earlier_use(limits: Limits) -> Use:
    """What the chain's attempts before this one used, as its record carries it."""
    return Use(limits.run_seconds, limits.gpu_seconds, limits.cost_usd)


def chain_use(record: RunRecord, rate: Rate, now: float) -> Use:
    """What the whole chain used up to this attempt, this one included."""
    return earlier_use(record.limits or Limits()) + attempt_use(record, rate, now)


def measured_save(record: RunRecord) -> float | None:
    """How long the attempt took from its snapshot request to a valid proof (the rest of its step and
    its save), or None when it did not snapshot."""
    stop = record.stop
    if record.snapshot is None or stop.requested_at is None or stop.proof_at is None:
        return None
    return max(0.0, stop.proof_at - stop.requested_at)


def learn_save(record: RunRecord, save: SaveLine | None) -> bool:
    """Take the attempt's newest periodic save (the plugin's last `save` line: the Trainer's own
    checkpoint save, timed in the job) as the chain's last measured save, so a chain's first stop is
    asked ahead of a save as long as its saves really take; True when that changed the record. A
    snapshot's request-to-proof time, measured when the attempt ends, is newer and replaces it
    (`carried`)."""
    limits = record.limits
    if limits is None or save is None or save.seconds is None or save.seconds < 0:
        return False
    if limits.save_seconds == save.seconds:
        return False
    limits.save_seconds = save.seconds
    return True


def carried(prev: RunRecord, rate: Rate, now: float) -> Limits | None:
    """The next attempt's limits: the chain's, with the totals up to the end of `prev` (`rate` is
    prev's) and the newest save measured on the chain; nothing reached yet."""
    if prev.limits is None:
        return None
    use = chain_use(prev, rate, now)
    return prev.limits.model_copy(
        update={
            "run_seconds": use.run_seconds,
            "gpu_seconds": use.gpu_seconds,
            "cost_usd": use.cost_usd,
            "save_seconds": measured_save(prev) or prev.limits.save_seconds,
            "reached": None,
        }
    )


# --- how far each limit is --------------------------------------------------------------------


def lead(save_seconds: float | None, save_floor: float, margin: float) -> float:
    """How long before a limit the snapshot is asked: the last measured save (never less than the
    floor), plus the margin."""
    return max(save_floor, save_seconds or 0.0) + margin


def left(limits: Limits, use: Use, rate: Rate, now: float, chain_start: float) -> list[Left]:
    """Each limit the chain has, and how much of it is left at the attempt's rate. A budget whose
    rate is nothing (no GPUs counted, no price yet) does not run down, and is left out."""
    out = []
    if limits.time_limit is not None:
        out.append(Left(TIME_LIMIT, DEADLINE, limits.time_limit - use.run_seconds, limits.time_limit))
    if limits.deadline is not None:
        out.append(Left(DEADLINE_LIMIT, DEADLINE, limits.deadline - now, max(0.0, limits.deadline - chain_start)))
    if limits.max_gpu_hours is not None and rate.gpus > 0:
        budget = limits.max_gpu_hours * 3600.0
        out.append(Left(GPU_BUDGET, COST, (budget - use.gpu_seconds) / rate.gpus, budget / rate.gpus))
    if limits.max_cost_usd is not None and rate.usd_per_hour:
        per_second = rate.usd_per_hour / 3600.0
        out.append(
            Left(COST_BUDGET, COST, (limits.max_cost_usd - use.cost_usd) / per_second, limits.max_cost_usd / per_second)
        )
    return out


def ahead(item: Left, lead_seconds: float) -> float:
    """How long before this limit its snapshot is asked: the lead, at most half the limit's span."""
    return min(lead_seconds, item.span / 2.0)


def due(limits: Limits, use: Use, rate: Rate, now: float, chain_start: float, lead_seconds: float) -> Left | None:
    """The limit whose snapshot must be asked now (the one with the least left), or None."""
    ready = [item for item in left(limits, use, rate, now, chain_start) if item.seconds <= ahead(item, lead_seconds)]
    return min(ready, key=lambda item: item.seconds) if ready else None


def scheduler_asked(
    limits: Limits, use: Use, rate: Rate, now: float, chain_start: float, lead_seconds: float
) -> Left | None:
    """The time limit or deadline a `deadline` request from the job's side belongs to: one this close
    (`SCHEDULER_SLACK` beyond its lead), as the scheduler obd gave it to signals; else None."""
    near = [
        item
        for item in left(limits, use, rate, now, chain_start)
        if item.reason == DEADLINE and item.seconds <= ahead(item, lead_seconds) + SCHEDULER_SLACK
    ]
    return min(near, key=lambda item: item.seconds) if near else None


def check(record: RunRecord, rate: Rate, now: float, save_floor: float, margin: float) -> Left | None:
    """The limit a running attempt reached now, or None: the limit obd must ask a snapshot for (no
    request yet), or the one a `deadline` request written on the job's side (its scheduler's
    signal) stands for. A stop already asked otherwise (a user's, a preemption's) stays that."""
    limits = record.limits
    if limits is None or not record.has_job:
        return None
    use = chain_use(record, rate, now)
    start = chain_start(record)
    ahead_s = lead(limits.save_seconds, save_floor, margin)
    if record.stop.requested_at is None:
        return due(limits, use, rate, now, start, ahead_s)
    if record.stop.reason == DEADLINE and record.stop.asked_by is None:
        return scheduler_asked(limits, use, rate, now, start, ahead_s)
    return None


def spent(prev: RunRecord, rate: Rate, now: float, save_floor: float, margin: float) -> Left | None:
    """The limit that leaves no room for another attempt of the chain after `prev` (one that would be
    asked to stop as soon as it ran), or None."""
    nxt = carried(prev, rate, now)
    if nxt is None:
        return None
    return due(nxt, earlier_use(nxt), rate, now, chain_start(prev), lead(nxt.save_seconds, save_floor, margin))


def too_late(record: RunRecord, now: float, save_floor: float, margin: float) -> str | None:
    """Why a queued run must not start: its deadline is so near that its snapshot would be asked
    as soon as it ran (the rule `due` applies to a running attempt); None while it may still start."""
    at = too_late_at(record, save_floor, margin)
    if at is None or now < at:
        return None
    assert record.limits is not None and record.limits.deadline is not None
    when = datetime.fromtimestamp(record.limits.deadline).isoformat(timespec="seconds")
    again = (
        f"`obd train resume {record.id} --deadline TIME` resumes its chain"
        if record.attempt > 1 or record.resumed_from
        else "start it again with a later --deadline"
    )
    return f"cancelled while queued: its deadline ({when}) came before it could start, so nothing of it ran; {again}"


def too_late_at(record: RunRecord, save_floor: float, margin: float) -> float | None:
    """When a queued run becomes `too_late`: its deadline less the lead a running attempt's
    snapshot would be asked with (at most half the deadline's span); None without a deadline."""
    if record.limits is None or record.limits.deadline is None:
        return None
    deadline = record.limits.deadline
    item = Left(DEADLINE_LIMIT, DEADLINE, 0.0, max(0.0, deadline - chain_start(record)))
    return deadline - ahead(item, lead(record.limits.save_seconds, save_floor, margin))


def chain_start(record: RunRecord) -> float:
    """When the chain first queued: a deadline's span counts from there."""
    return record.preemption.queue_since or record.created


def job_time(record: RunRecord, rate: Rate, now: float, save_floor: float, margin: float) -> tuple[float, float] | None:
    """What the time limit and the deadline leave the attempt about to start: (wall seconds it may
    run, how long before that its snapshot is asked), for a scheduler that ends jobs on time; None
    when the chain has neither. Budgets are the daemon's to enforce (a scheduler counts no dollars)."""
    if record.limits is None:
        return None
    use = earlier_use(record.limits)
    ahead_s = lead(record.limits.save_seconds, save_floor, margin)
    times = [i for i in left(record.limits, use, rate, now, chain_start(record)) if i.reason == DEADLINE]
    if not times:
        return None
    first = min(times, key=lambda item: item.seconds)
    return max(1.0, first.seconds), ahead(first, ahead_s)


# --- words and numbers for people ------------------------------------------------------------------


def words(seconds: float) -> str:
    """`45s`, `12m05s`, `2h03m`: a span of time as `status` and the history say it."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def asked_by(item: Left, limits: Limits, use: Use) -> str:
    """Who asks, as the run's history says it: `its time limit (2h, 1h58m30s used)`."""
    if item.limit == TIME_LIMIT and limits.time_limit is not None:
        return f"its time limit ({words(limits.time_limit)}, {words(use.run_seconds)} used)"
    if item.limit == GPU_BUDGET and limits.max_gpu_hours is not None:
        return f"its GPU-hour budget ({limits.max_gpu_hours:g} GPU-hours, {use.gpu_seconds / 3600:.3g} used)"
    if item.limit == COST_BUDGET and limits.max_cost_usd is not None:
        return f"its cost budget (${limits.max_cost_usd:.2f}, ${use.cost_usd:.2f} spent)"
    return f"its deadline ({words(max(0.0, item.seconds))} away)"


def capped_lead(item: Left, save_seconds: float | None, save_floor: float, margin: float) -> str:
    """Why a snapshot was asked earlier or later than its lead says, when the lead was capped at
    half the limit (a short limit): `; asked 10s before it, half the limit: ...`; "" otherwise."""
    full = lead(save_seconds, save_floor, margin)
    asked = ahead(item, full)
    if asked >= full:
        return ""
    if save_seconds is not None and save_seconds > save_floor:
        source = f"the chain's last measured save, {words(save_seconds)}"
    else:
        source = f"the save floor, {words(save_floor)} ([limits] save_floor)"
    return (
        f"; asked {words(asked)} before it, at half the limit: its lead of {words(full)} ({source}, "
        f"plus a margin of {words(margin)}) is more than half the limit, and the lead is capped at half "
        "so that a short limit still trains"
    )


def report(record: RunRecord, rate: Rate, now: float, save_floor: float, margin: float) -> dict[str, Any] | None:
    """The chain's limits, used and left, as `obd train status --json` has them (`usage`); None
    without limits. `record` is the chain's newest attempt."""
    limits = record.limits
    if limits is None:
        return None
    use = chain_use(record, rate, now)
    out: dict[str, Any] = {
        "used": {
            "run_seconds": round(use.run_seconds, 1),
            "gpu_hours": round(use.gpu_seconds / 3600.0, 6),
            "cost_usd": round(use.cost_usd, 4),
        },
        "gpus": rate.gpus,
        "usd_per_hour": rate.usd_per_hour,
        "save_seconds": limits.save_seconds,
        "lead_seconds": lead(limits.save_seconds, save_floor, margin),
        "reached": limits.reached,
    }
    if limits.time_limit is not None:
        out["time_limit"] = _used_left(limits.time_limit, use.run_seconds, 1)
    if limits.deadline is not None:
        out["deadline"] = {"at": limits.deadline, "left": round(max(0.0, limits.deadline - now), 1)}
    if limits.max_gpu_hours is not None:
        out["gpu_hours"] = _used_left(limits.max_gpu_hours, use.gpu_seconds / 3600.0, 6)
    if limits.max_cost_usd is not None:
        out["cost_usd"] = _used_left(limits.max_cost_usd, use.cost_usd, 4)
    return out


def _used_left(limit: float, used: float, digits: int) -> dict[str, float]:
    return {"limit": limit, "used": round(used, digits), "left": round(max(0.0, limit - used), digits)}


# --- at start ----------------------------------------------------------------------------------------


def from_request(req: StartRequest | Any) -> Limits | None:
    """The limits a start gave, or None when it gave none."""
    given = {k: getattr(req, k, None) for k in ("time_limit", "deadline", "max_gpu_hours", "max_cost_usd")}
    return Limits(**given) if any(v is not None for v in given.values()) else None


def refusal(limits: Limits | None, target: AnyTarget, target_name: str, gpus: int, now: float) -> str | None:
    """Why a start's limits cannot hold on its target, or None: a deadline already passed, a GPU-hour
    budget for a run with no GPUs counted, a cost budget where the target has no price."""
    if limits is None:
        return None
    if limits.deadline is not None and limits.deadline <= now:
        return "--deadline: that time has passed; give a time to come (14:00, or 2025-06-01T14:00)"
    counted = gpus_counted(target, gpus)
    if limits.max_gpu_hours is not None and not counted:
        if counted is None:
            return (
                f"--max-gpu-hours: target {target_name} does not say how many GPUs its jobs use; set `gpu_count` "
                f"(SSH) or `gpus_per_node` (Slurm) in [targets.{target_name}], or drop --max-gpu-hours"
            )
        return "--max-gpu-hours: this run has no GPUs (--gpus 0, or a target without any), so it uses no GPU-hours"
    if limits.max_cost_usd is not None and not has_price(target):
        return (
            f"--max-cost-usd: target {target_name} has no price; set `price_per_gpu_hour` in "
            f"[targets.{target_name}] (US dollars an hour of one GPU), or drop --max-cost-usd"
        )
    if limits.max_cost_usd is not None and not makes_pods(target) and not counted:
        return (
            f"--max-cost-usd: this run has no GPUs counted to price (`price_per_gpu_hour` is per GPU); "
            f"give it GPUs, or set `gpu_count` (SSH) or `gpus_per_node` (Slurm) in [targets.{target_name}]"
        )
    return None


def check_start(
    req: StartRequest, target: AnyTarget, wanted: int | list[str] | None, inventory: int, now: float
) -> None:
    """Refuse a start whose limits cannot hold, before anything is saved (`refusal`); `wanted` is its
    `--gpus` (None: all `inventory` of them, on a target where obd hands GPUs out)."""
    gpus = inventory if wanted is None else wanted if isinstance(wanted, int) else len(wanted)
    why = refusal(from_request(req), target, req.target, gpus, now)
    if why is not None:
        raise ApiError(why, "usage")


# --- what the daemon's parts call ------------------------------------------------------------------


def rate_of(daemon: Runs, record: RunRecord, now: float) -> Rate:
    """The attempt's rate from its target's config and its record (its GPUs, its pod)."""
    try:
        target = daemon.config.target(record.target)
    except Exception:  # a target gone from the config: nothing counted beyond the time
        return Rate()
    gpus = gpus_counted(target, len(record.gpus)) or 0
    per_hour, spent_usd = run_price(target, gpus, record.target_info, now)
    return Rate(gpus, per_hour, spent_usd)


def settings(daemon: Runs) -> tuple[float, float]:
    """`[limits] save_floor` and `margin`."""
    section = daemon.config.limits
    return float(section.save_floor), float(section.margin)


def carry(daemon: Runs, prev: RunRecord, now: float) -> Limits | None:
    """`carried` for the next attempt after `prev` (the launch's `next_attempt`)."""
    return carried(prev, rate_of(daemon, prev, now), now)


def spent_of(daemon: Runs, prev: RunRecord, now: float) -> Left | None:
    """`spent` for the chain of an attempt that ended (recovery: no next attempt when it is)."""
    return spent(prev, rate_of(daemon, prev, now), now, *settings(daemon))


def check_of(daemon: Runs, record: RunRecord, now: float) -> tuple[Left, str] | None:
    """`check` for a running attempt (the follow's call on every poll): the limit reached, and who
    asks for its snapshot in the history's words."""
    if record.limits is None:
        return None
    rate = rate_of(daemon, record, now)
    floor, margin = settings(daemon)
    item = check(record, rate, now, floor, margin)
    if item is None:
        return None
    said = asked_by(item, record.limits, chain_use(record, rate, now))
    return item, said + capped_lead(item, record.limits.save_seconds, floor, margin)


def report_of(daemon: Runs, record: RunRecord, now: float) -> dict[str, Any] | None:
    """`report` of a chain's newest attempt, for `status`."""
    return report(record, rate_of(daemon, record, now), now, *settings(daemon))


def too_late_of(daemon: Runs, record: RunRecord, now: float) -> str | None:
    """`too_late` with the daemon's save floor and margin (the queue's check of a waiting run)."""
    if record.limits is None:  # most runs: the queue asks for each of thousands a pass
        return None
    return too_late(record, now, *settings(daemon))


def too_late_at_of(daemon: Runs, record: RunRecord) -> float | None:
    """`too_late_at` with the daemon's settings: when the queue must look at the run again."""
    if record.limits is None:
        return None
    return too_late_at(record, *settings(daemon))


def job_time_of(daemon: Runs, record: RunRecord, now: float) -> tuple[float | None, float | None]:
    """`job_time` for the attempt about to start, as the launch gives it to the job: (None, None) without one."""
    found = job_time(record, rate_of(daemon, record, now), now, *settings(daemon))
    return found if found is not None else (None, None)
