"""Runs that wait for runs: `obd train start --after RUN[:STATE[,STATE]]` (docs/dependencies-and-sweeps.md).

A run started with `--after` waits `queued` until the chain of every run it names has ended:
its newest attempt is final and no further attempt will come (no retry due, no paused attempt
to come back). If each ended in one of the states asked (`succeeded` or `stopped` by default),
the run goes on through the queue like any other; if one ended otherwise, the run is cancelled,
saying which run ended how, unless it was started with `--after-any` (it then starts whatever
the ends). `decide` is that rule alone, pure and table-tested; the queue (daemon/service/queue.py) asks
it on every pass, so a daemon killed at any moment decides again from the records alone.

Each reference is resolved once, when the run is started, to the first attempt of the named
run's chain, and kept in the record: a name or `last` is never read again, so it cannot come
to name the waiting run itself later. A cycle of waits could only be made of references that
name the new run (it does not exist yet when they are resolved): its own `--name` is refused,
and `cycle` is checked all the same, over the records, in case a record says otherwise.

The job learns where each earlier run's outputs are: `OBD_AFTER_<n>_OUTPUT` (n from 1, in the
order given) and `OBD_AFTER_<NAME>_OUTPUT` for a run that has a name (`output_env`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from daemon.common import wire
from daemon.service.api import ApiError, Peer, StartRequest
from daemon.service.checkpoints import latest_attempt
from daemon.service.models import DependenciesPart, Dependency, RunRecord
from daemon.service.ports import Runs
from daemon.service.targets import Targets
from trainer_plugin import rundir

DEFAULT_STATES = (wire.SUCCEEDED, wire.STOPPED)
ENDS = (wire.STOPPED, wire.SUCCEEDED, wire.FAILED, wire.CANCELLED)  # the states a chain can end in


class Continues(Protocol):
    """Recovery as a waiting run sees it: whether an ended attempt's chain goes on."""

    def attempt_to_come(self, record: RunRecord) -> bool: ...


class AfterHost(Runs, Protocol):
    """What deciding a waiting run needs of the daemon: the records (chains), and recovery."""

    @property
    def recovery(self) -> Continues: ...

    @property
    def targets(self) -> Targets: ...


class FindHost(Runs, Protocol):
    """What resolving `--after` at start needs: the caller's runs by reference."""

    def find(self, ref: str, peer: Peer) -> RunRecord: ...


class OutputsHost(Runs, Protocol):
    """What telling a job where the earlier runs' outputs are needs: the targets."""

    @property
    def targets(self) -> Targets: ...


# --- the rule ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainEnd:
    """How the chain a run waits for stands now."""

    label: str  # `run NAME` or `run ID`, as messages name it
    latest: str  # the id of its newest attempt
    state: str  # that attempt's state
    over: bool  # final, and no further attempt of the chain will come
    message: str = ""  # that attempt's message


@dataclass(frozen=True)
class Verdict:
    """What the queue does with a waiting run now, and why, in words for its record."""

    action: Literal["wait", "start", "cancel"]
    why: str


def label(dep: Dependency) -> str:
    return f"run {dep.name or dep.run}"


def _states_text(states: Sequence[str]) -> str:
    return " or ".join(states)


def decide(waits: Sequence[tuple[Dependency, ChainEnd | None]], after_any: bool) -> Verdict:
    """Wait, start or cancel a run that waits for the chains in `waits` (None: a chain whose
    record is gone or unreadable, which will never end as asked).

    - any chain not over, and none ended otherwise (or `after_any`): wait, naming those not over;
    - one ended otherwise (not in its states, or its record gone), without `after_any`: cancel at
      once, naming it, its state and its message (there is no point in waiting for the others);
    - every chain over: start (with `after_any` whatever the ends, saying which were not asked).
    """
    bad: list[str] = []
    pending: list[str] = []
    ended: list[str] = []
    for dep, end in waits:
        if end is None:
            bad.append(f"{label(dep)}'s record is missing or unreadable, so it will never end as asked")
            continue
        if not end.over:
            coming = "; another attempt is to come" if end.state in wire.FINAL else ""
            pending.append(f"{end.label} ({end.state}{coming})")
            continue
        if end.state in dep.states:
            ended.append(f"{end.label} ended {end.state}")
        else:
            said = f": {end.message}" if end.message else ""
            attempt = f" (attempt {end.latest})" if end.latest != dep.run else ""
            bad.append(f"{end.label}{attempt} ended {end.state}, not {_states_text(dep.states)}{said}")
    if bad and not after_any:
        return Verdict(
            "cancel",
            "cancelled while queued: "
            + "; ".join(bad)
            + ". Start it again once that run is fixed, or with --after-any to start whatever its end",
        )
    if pending:
        return Verdict("wait", "waiting for " + ", ".join(pending))
    if bad:
        return Verdict("start", "its wait is over (--after-any): " + "; ".join(ended + bad))
    return Verdict("start", "its wait is over: " + "; ".join(ended))


def cycle(own: str, waits: Iterable[str], waits_of: Callable[[str], Iterable[str]]) -> list[str] | None:
    """The chains of a loop of waits through `own`, when waiting for `waits` would close one
    (`own` first, then each chain waited for in turn back to it), else None. `waits_of(chain)`
    is what a chain waits for (the deps of all its attempts)."""
    seen: set[str] = set()
    stack: list[tuple[str, list[str]]] = [(chain, [own, chain]) for chain in waits]
    while stack:
        chain, path = stack.pop()
        if chain == own:
            return path
        if chain in seen:
            continue
        seen.add(chain)
        stack.extend((nxt, [*path, nxt]) for nxt in waits_of(chain))
    return None


# --- at start ---------------------------------------------------------------------------------


def parse_after(text: str) -> tuple[str, list[str]]:
    """`RUN[:STATE[,STATE]]` as (RUN, states); the states default to succeeded or stopped. The last
    `:` splits: a run whose name holds one is named by its id."""
    ref, sep, tail = text.rpartition(":")
    if not sep:
        ref, tail = text, ""
    if not ref.strip():
        raise ApiError(f"--after {text!r}: name a run (an id, a name or `last`), e.g. --after sft:succeeded", "usage")
    if not sep:
        return ref, list(DEFAULT_STATES)
    states = [word.strip() for word in tail.split(",") if word.strip()]
    unknown = [word for word in states if word not in ENDS]
    if not states or unknown:
        raise ApiError(
            f"--after {text}: {', '.join(unknown) or 'no state'} is not a state a run ends in; give one or more "
            f"of {', '.join(ENDS)} after the colon (default: {_states_text(DEFAULT_STATES)})",
            "usage",
        )
    return ref, list(dict.fromkeys(states))


def chain_waits(records: dict[str, RunRecord]) -> Callable[[str], list[str]]:
    """`waits_of` for `cycle` over the records: what each chain waits for, all its attempts' deps."""
    by_chain: dict[str, list[str]] = {}
    for record in records.values():
        if record.dependencies.after:
            by_chain.setdefault(record.chain or record.id, []).extend(d.run for d in record.dependencies.after)
    return lambda chain: by_chain.get(chain, [])


def resolve(daemon: FindHost, req: StartRequest, peer: Peer, own: str) -> list[Dependency]:
    """The runs a new run `own` waits for, each resolved now to its chain's first attempt (only the
    caller's runs, as for any reference); what would be a wait for itself, or a run named twice,
    is refused, saying so."""
    deps: list[Dependency] = []
    given: dict[str, str] = {}
    for text in req.after:
        ref, states = parse_after(text)
        if req.name is not None and ref == req.name:
            raise ApiError(
                f"--after {ref}: {ref} is also this run's --name, and once it starts `{ref}` names this run: it "
                f"would wait for itself. Name the earlier run by its id (`obd train list --name {ref}` shows it)",
                "usage",
            )
        try:
            found = daemon.find(ref, peer)
        except ApiError as exc:
            raise ApiError(f"--after {ref}: {exc}", exc.kind) from exc
        chain = found.chain or found.id
        if chain == own:
            raise ApiError(f"--after {ref}: a run cannot wait for itself", "usage")
        if chain in given:
            raise ApiError(
                f"--after {given[chain]} and --after {text} name the same run ({chain}); give it once, "
                "with every state it may end in (e.g. --after RUN:succeeded,failed)",
                "usage",
            )
        given[chain] = text
        first = daemon.records.get(chain, found)
        deps.append(Dependency(run=chain, given=ref, name=first.name, states=states))
    if not deps:
        return deps  # nothing to look through (a look at every run's waits, for each member of a sweep)
    loop = cycle(own, [d.run for d in deps], chain_waits(daemon.records))
    if loop is not None:
        raise ApiError(
            "--after would make a loop of runs that wait for each other (" + " -> ".join(loop) + "): none of them "
            "could ever start; start it without the --after that closes the loop",
            "usage",
        )
    return deps


def attach(daemon: FindHost, req: StartRequest, peer: Peer, record: RunRecord) -> None:
    """A new run's dependencies put on its record (saved by the caller): the runs it waits for, each
    resolved now (`resolve`), and whether it starts whatever they ended in (`--after-any`)."""
    record.dependencies = DependenciesPart(after=resolve(daemon, req, peer, record.id), after_any=req.after_any)


def announced(record: RunRecord) -> str | None:
    """What a new run that waits for runs says it waits for, before the queue looks at them."""
    if not record.dependencies.after:
        return None
    return "waiting for " + ", ".join(label(d) for d in record.dependencies.after)


# --- in the queue -----------------------------------------------------------------------------


def chain_end(daemon: AfterHost, dep: Dependency) -> ChainEnd | None:
    """How the chain `dep` waits for stands now (None: its record is gone or unreadable)."""
    first = daemon.records.get(dep.run)
    if first is None:
        return None
    latest = latest_attempt(daemon, first)
    over = latest.state.final and not daemon.recovery.attempt_to_come(latest)
    return ChainEnd(label(dep), latest.id, latest.state.value, over, latest.message)


def verdict(daemon: AfterHost, record: RunRecord) -> Verdict:
    """`decide` for a queued run, from the records as they are now."""
    return decide([(dep, chain_end(daemon, dep)) for dep in record.dependencies.after], record.dependencies.after_any)


def in_between(daemon: AfterHost, record: RunRecord) -> bool:
    """Whether a chain the run waits for has a final newest attempt whose next one is still to be
    made (a retry or a paused run's way back under way): the queue looks again shortly, as the
    end of that step changes no record."""
    for dep in record.dependencies.after:
        end = chain_end(daemon, dep)
        if end is not None and not end.over and end.state in wire.FINAL:
            return True
    return False


# --- the job's environment --------------------------------------------------------------------

_NOT_NAME = re.compile(r"[^A-Z0-9]+")


def env_name(name: str) -> str | None:
    """`OBD_AFTER_<NAME>_OUTPUT` for a run name: upper case, every run of other characters one `_`;
    None when nothing of it is left."""
    word = _NOT_NAME.sub("_", name.upper()).strip("_")
    return f"OBD_AFTER_{word}_OUTPUT" if word else None


def output_path(daemon: OutputsHost, record: RunRecord, earlier: RunRecord) -> tuple[str | None, str]:
    """Where `record`'s job finds `earlier`'s outputs, and, when nowhere, why (for its history).

    On the same target (this machine, the same SSH host or cluster): the earlier run's `output/`
    in place. Elsewhere, for a job on this machine: the copy obd brought home from a pod (under
    the state directory) when the daemon runs as the job's user, who can read it. Otherwise none:
    `obd train outputs` copies them."""
    targets = daemon.targets
    copy_hint = f"`obd train outputs {earlier.id} --to DIR` copies them"
    if not earlier.remote_dir:
        return None, f"run {earlier.id} has no run directory (it never started)"
    if targets.key(earlier) == targets.key(record):
        return rundir.RunPaths(earlier.remote_dir).output, ""
    home = rundir.RunPaths(daemon.store.run_dir(earlier.id) / "retrieved").output
    try:
        here = targets.of(record).shares_filesystem(record)
    except ApiError:
        here = False
    if here and record.owner_uid == os.geteuid() and os.path.isdir(home):
        return home, ""
    return None, f"run {earlier.id} ran on target {earlier.target}, another machine than this run's; {copy_hint}"


def waited_for(records: dict[str, RunRecord], record: RunRecord) -> list[Dependency]:
    """The runs a run's job is told about: those it waited for; for a later attempt of a chain (a
    retry, a paused run's way back), those its chain's first attempt waited for; for a run resumed
    from another, those that one's were (its job runs the same command, which may need them)."""
    seen: set[str] = set()
    current: RunRecord | None = record
    while current is not None and current.id not in seen:
        seen.add(current.id)
        if current.dependencies.after:
            return current.dependencies.after
        first = records.get(current.chain or current.id, current)
        if first.dependencies.after:
            return first.dependencies.after
        current = records.get(first.resumed_from or "") if first.resumed_from else None
    return []


async def output_env(daemon: OutputsHost, record: RunRecord) -> dict[str, str]:
    """`OBD_AFTER_<n>_OUTPUT` (and `OBD_AFTER_<NAME>_OUTPUT`) for a run that waited for runs
    (`waited_for`): the output/ of each chain's newest attempt, where the job can reach it; a
    dependency whose outputs it cannot reach gets no variable, and the run's history says why
    and how to copy them."""
    env: dict[str, str] = {}
    notes: list[str] = []
    for n, dep in enumerate(waited_for(daemon.records, record), 1):
        first = daemon.records.get(dep.run)
        if first is None:
            notes.append(f"OBD_AFTER_{n}_OUTPUT not set: the record of run {dep.run} is missing")
            continue
        earlier = latest_attempt(daemon, first)
        path, why = output_path(daemon, record, earlier)
        if path is None:
            notes.append(f"OBD_AFTER_{n}_OUTPUT not set: {why}")
            continue
        env[f"OBD_AFTER_{n}_OUTPUT"] = path
        named = env_name(dep.name) if dep.name else None
        if named is not None:
            env.setdefault(named, path)
    if notes:
        async with daemon.editing(record):
            for note in notes:
                record.note(note)
    return env
