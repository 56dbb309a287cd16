"""Placement over several targets, and overflow (docs/placement.md).

`--target a,b,c` (or a pool of the config, `[pools.NAME] targets = [...]`) names targets in order of
preference: the run is queued, and the queue starts it on the first of them that can start it now
(not drained, the GPUs it asks for free there, no run ahead of it in that target's queue); while
none can, it waits on the first, and starts on the first that frees. A target's `overflow` is one
more target a run queued on it may start on, once it has waited `overflow_after` there (a run paused
by a preemption or a drain is queued again as its chain's next attempt: the wait counts from then),
so a run paused on a drained box continues on the overflow target from its snapshot, through the
same carry as `obd train resume RUN --target T` (daemon/service/carry.py).

What is decided here, from the config and the records alone: which targets a `--target` names
(`resolve`), which a queued run may start on now (`candidates`), where the next attempt of a chain
starts (`for_next_attempt`: a target that was down goes last), and what a run placed on another
target changes in its record (`settle`). The queue (daemon/service/queue.py) makes the choice.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from daemon.service.api import ApiError, StartRequest
from daemon.service.config import Config, ConfigError
from daemon.service.models import Placement, RunRecord
from daemon.service.policy import may_use, owner_peer, restricted
from daemon.service.targets import Targets

# The causes of a retry that say the target itself failed (its job was lost, its launch failed):
# the next attempt tries the chain's other targets first.
DOWN = frozenset({"launch", "lost"})


def words(seconds: float) -> str:
    """A wait as the config would spell it: `10m`, `90s`."""
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def known_targets(config: Config) -> list[str]:
    return sorted({"local", *config.targets})


def resolve(config: Config, text: str) -> tuple[list[str], bool]:
    """The targets `--target TEXT` names, in order of preference, and whether it is a placement (a
    list or a pool) rather than one target; ApiError (usage) saying what to give when it names a
    target or pool the config does not have."""
    text = text.strip()
    known = known_targets(config)
    if text in known:
        return [text], False
    parts = [part.strip() for part in text.split(",")]
    found: list[str] = []
    unknown = []
    for part in parts:
        if part in config.pools:
            found += config.pools[part].targets
        elif part in known:
            found.append(part)
        else:
            unknown.append(part)
    if unknown or not found:
        pools = ", ".join(sorted(config.pools)) or "none ([pools.NAME] targets = [...] in the config makes one)"
        what = ", ".join(repr(u) for u in unknown if u) or "an empty name"
        raise ApiError(
            f"--target {text}: unknown target or pool {what}; the targets are: {', '.join(known)}; the pools: {pools} "
            "(`obd targets list`). Give one target, a pool, or targets in order of preference: --target a,b",
            "usage",
        )
    return list(dict.fromkeys(found)), True


def placement_of(config: Config, text: str) -> tuple[str, Placement | None]:
    """The target a new run is first queued on, and its placement when `text` names several."""
    targets, several = resolve(config, text)
    return targets[0], Placement(given=text.strip(), targets=targets) if several else None


def preferences(record: RunRecord) -> list[str]:
    return list(record.placement.targets) if record.placement is not None else [record.target]


def overflows(config: Config, targets: Iterable[str]) -> list[tuple[str, str, float]]:
    """(target, its overflow target, its wait) for each of `targets` that names one."""
    out = []
    for name in targets:
        try:
            target = config.target(name)
        except ConfigError:
            continue  # a target gone from the config: its runs are refused at their launch
        if target.overflow is not None:
            out.append((name, target.overflow, float(target.overflow_after)))
    return out


def reachable(config: Config, text: str) -> list[str]:
    """Every target a run started with `--target TEXT` may run on: its preferences and their overflows."""
    targets, _ = resolve(config, text)
    return list(dict.fromkeys([*targets, *(over for _, over, _ in overflows(config, targets))]))


def waiting_since(record: RunRecord) -> float:
    """When this attempt began to wait in the queue (after its backoff, for a retry)."""
    return max(record.created, record.not_before or 0.0)


def overflow_due(config: Config, record: RunRecord) -> list[tuple[str, str, float]]:
    """(target, overflow target, when it applies) for the run's preferences, the overflows not
    among them already, nor kept from the run's owner by `[policy]` (skipped: said at its start)."""
    prefs = preferences(record)
    since = waiting_since(record)
    return [
        (name, over, since + wait)
        for name, over, wait in overflows(config, prefs)
        if over not in prefs and may_use_owner(config, record, over)
    ]


def may_use_owner(config: Config, record: RunRecord, target: str) -> bool:
    """Whether the run's owner may use `target` (`[policy] target_users`/`target_groups`)."""
    return not restricted(config.policy, target) or may_use(config.policy, owner_peer(record.owner_uid), target)


def watched(config: Config, record: RunRecord) -> bool:
    """Whether the queue places this run (several targets, or an overflow to come)."""
    if record.placement is None:  # one target: the queue looks at thousands a pass, most of them such
        target = config.targets.get(record.target)
        if target is None or target.overflow is None:  # none named (`local`), or gone: no overflow
            return False
    return len(preferences(record)) > 1 or bool(overflow_due(config, record))


def watched_runs(config: Config, runs: list[RunRecord]) -> list[RunRecord]:
    """The runs of `runs` the queue places (`watched`): a look at the targets first, then at
    the runs of several targets or of a target with an overflow only (thousands queued on one
    target without are passed over at a set's look each)."""
    overflowing = {name for name, target in config.targets.items() if target.overflow is not None}
    return [r for r in runs if (r.placement is not None or r.target in overflowing) and watched(config, r)]


def candidates(config: Config, record: RunRecord, now: float) -> list[tuple[str, str | None]]:
    """The targets a queued run may start on now, in the order tried: its preferences, then the
    overflows whose wait is over; each with the target it overflows from (None for a preference)."""
    out: list[tuple[str, str | None]] = [(t, None) for t in preferences(record)]
    taken = {t for t, _ in out}
    for name, over, at in overflow_due(config, record):
        if at <= now and over not in taken:
            out.append((over, name))
            taken.add(over)
    return out


def waiting_words(config: Config, record: RunRecord, now: float) -> str:
    """What a placed run's wait adds to its queue message: its overflows still to come."""
    later = [(over, at) for _, over, at in overflow_due(config, record) if at > now]
    return "".join(
        f"; to {over} at {time.strftime('%H:%M:%S', time.localtime(at))} if still waiting (overflow)"
        for over, at in later
    )


def placed_why(record: RunRecord, target: str, source: str | None, config: Config, reasons: list[str]) -> str:
    """What `status` says of where a run was placed: the target, and why not the ones before it."""
    why = "; ".join(reasons) if reasons else f"the first of {record.placement.given if record.placement else target}"
    if source is None:
        return f"placed on {target}: {why}"
    wait = words(float(config.target(source).overflow_after))
    return f"placed on {target}, the overflow of {source} after {wait} waiting: {why}"


def for_next_attempt(config: Config, prev: RunRecord, given: str, cause: str) -> tuple[str, Placement | None]:
    """Where the next attempt of `prev`'s chain is queued, and its placement: the chain's targets as
    given at its start, then the target `prev` overflowed to (a candidate at once); the target
    `prev` ran on last when it was down (`DOWN`: its job lost, its launch failed)."""
    try:
        prefs, _ = resolve(config, given)
    except ApiError:
        prefs = [prev.target]  # the config changed since: where it ran
    if prev.target not in prefs:
        prefs.append(prev.target)
    if cause in DOWN and len(prefs) > 1:
        prefs.remove(prev.target)
        prefs.append(prev.target)
    if len(prefs) == 1:
        return prefs[0], None
    return prefs[0], Placement(given=given, targets=prefs)


def settle(targets: Targets, record: RunRecord, target: str, req: StartRequest | None) -> None:
    """A queued run placed on `target`: what its start there needs, as a start on it would have
    set it (its directory rule, whether its job starts from the caller's environment, its run
    directory where the workdir is known now). Raises ApiError when the target cannot serve it."""
    supervision = targets.get(target)
    record.target = target
    if req is not None:
        if supervision.shares_filesystem(record):
            record.cwd = req.cwd or req.client_cwd
            record.env_from_caller = not req.env_clear and req.environ is not None
        else:
            record.cwd = req.cwd  # uploaded into the run directory (src/)
            record.env_from_caller = False
    workdir = supervision.workdir(record)
    record.remote_dir = f"{workdir.rstrip('/')}/{record.id}" if workdir.startswith("/") else ""


__all__ = [
    "DOWN",
    "candidates",
    "for_next_attempt",
    "overflow_due",
    "placed_why",
    "placement_of",
    "reachable",
    "resolve",
    "settle",
    "waiting_words",
    "watched",
]
