"""Which GPUs a run asks for, which a target has, and which are free.

A local target's GPUs are found with the vendors' tools or given by its config (the factory's
`gpu_inventory`, with `executors/gpus.py`). A run holds the devices it was given from the moment
it leaves the queue until its record is final; no two runs ever hold the same device. A run
without `--gpus` on a target that has GPUs asks for all of them (a fine-tune uses the box; two
never fight over it).
Targets that do not share the daemon's machine (SSH, pods, Slurm) have no inventory here: their
jobs see what their machine gives them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.to_thread
import structlog

from daemon.service.api import ApiError
from daemon.service.models import RunRecord, RunState
from daemon.service.ports import Runs
from daemon.service.records import Records
from daemon.service.targets import Targets
from executors.factory import gpu_inventory
from executors.gpus import Gpu, compute_pids

log = structlog.get_logger("obd.gpus")
LINGER_POLL = 0.25  # seconds between looks for an ended run's last process


# What a pass of the queue said of a target's GPUs, by target and GPUs asked (a count or device ids),
# while their holders stay the same (Inventory.waiting_for).
GpuWords = dict[tuple[str, int | tuple[str, ...]], str]


class InventoryHost(Runs, Protocol):
    """What the GPU inventory uses of the daemon beyond the records: the targets' GPUs."""

    @property
    def targets(self) -> Targets: ...


def parse_wanted(text: str | None) -> int | list[str] | None:
    """`--gpus`: N devices, `0,2` (or `device=0`) those devices, `all`; None when not given."""
    if text is None or text.strip() == "all":
        return None
    text = text.strip()
    if text.startswith("device="):
        text = text[len("device=") :] + ","
    if "," in text:
        ids = [part.strip() for part in text.split(",") if part.strip()]
        if not ids or len(set(ids)) != len(ids):
            raise ApiError(f"--gpus {text!r}: name each device once, e.g. --gpus 0,2", "usage")
        return ids
    if text.isdigit() and int(text) <= 64:
        return int(text)
    raise ApiError(f"--gpus {text!r}: use a number of GPUs (2), device ids (0,2 or device=1), or all", "usage")


class Inventory:
    """The GPUs of each target, looked up once (discovery runs the vendors' tools)."""

    def __init__(self, daemon: InventoryHost) -> None:
        self.daemon = daemon
        self._by_target: dict[str, list[Gpu]] = {}
        self._clear: set[str] = set()  # ended runs found with no process left
        # Ended runs with GPUs not yet found clear, and how many of the records' ended runs were looked at.
        self._unclear: dict[str, RunRecord] = {}
        self._ended_seen: tuple[Records | None, int] = (None, 0)  # (the records, count)
        self._watching: set[str] = set()  # targets watched for an ended run's last process
        self.wake: Callable[[], None] | None = None  # the queue's kick, once a device is free again

    def of(self, target: str) -> list[Gpu]:
        if target not in self._by_target:
            self._by_target[target] = self._find(target)
        return self._by_target[target]

    def _find(self, target: str) -> list[Gpu]:
        return gpu_inventory(self.daemon.targets.get(target).config)

    def wanted(self, record: RunRecord, target: str | None = None) -> list[str] | int:
        """What a run asks for on its target (or on `target`, where it may be placed): device ids,
        or a count; 0 on a target whose GPUs obd does not hand out (its machine gives them)."""
        gpus = self.of(target or record.target)
        if record.gpus_wanted is None or not gpus:
            return len(gpus)
        return record.gpus_wanted

    def check(self, target: str, wanted: int | list[str] | None) -> None:
        """Refuse at start what the target can never give."""
        gpus = self.of(target)
        if wanted is None or wanted == 0:
            return
        if not gpus:
            raise ApiError(
                f"target {target} has no GPUs obd hands out (none found with nvidia-smi or amd-smi, and no "
                "`gpus` in its config); drop --gpus, or set gpus in [targets." + target + "]",
                "usage",
            )
        ids = {g.id for g in gpus}
        if isinstance(wanted, list):
            unknown = [w for w in wanted if w not in ids]
            if unknown:
                raise ApiError(
                    f"--gpus: target {target} has no device {', '.join(unknown)} (it has {', '.join(sorted(ids))})",
                    "usage",
                )
        elif wanted > len(gpus):
            raise ApiError(f"--gpus {wanted}: target {target} has only {len(gpus)} GPUs", "usage")

    def held(self, target: str) -> dict[str, str]:
        """device id -> the run holding it, on one target: a run that has not ended, or one that
        ended while a process of it remains (its GPU is never handed out before that is gone)."""
        holders: dict[str, str] = {}
        for record in self.daemon.records.active():  # 5,000 queued runs hold nothing
            if record.target != target or not record.gpus or record.state == RunState.queued:
                continue
            for device in record.gpus:
                holders[device] = record.id
        ended = self._unclear_of(target)
        if ended:
            for rid in sorted(self._lingering(target, ended)):
                for device in ended[rid].gpus:
                    holders.setdefault(device, rid)
        return holders

    def _unclear_of(self, target: str) -> dict[str, RunRecord]:
        """The ended runs of `target` with GPUs not yet found clear of their processes: the runs
        found ended since the last look are added, those found clear since are dropped (call it
        after `records.active()`, which finds the runs with GPUs that ended)."""
        records = self.daemon.records
        seen_records, seen = self._ended_seen
        if seen_records is not records:  # the records loaded anew: every ended run looked at again
            seen = 0
        news = records.ended_since(seen)
        self._ended_seen = (records, seen + len(news))
        for record in news:
            if record.gpus and record.id not in self._clear:
                self._unclear[record.id] = record
        for run_id in [r for r in self._unclear if r in self._clear]:
            del self._unclear[run_id]
        return {run_id: r for run_id, r in self._unclear.items() if r.target == target}

    def _lingering(self, target: str, ended: dict[str, RunRecord]) -> set[str]:
        """Which of these ended runs still have a process (their target's executor says, where it
        can: the local one, by their cgroup or identity); the others are clear for good. While
        one lingers, the queue is woken once it is gone."""
        found = self._check(target, ended)
        if found and target not in self._watching and self.daemon.started:
            self._watching.add(target)
            self.daemon.start_soon(self._watch, target)
        return found

    def _check(self, target: str, ended: dict[str, RunRecord]) -> set[str]:
        """The ended runs with a process left; the others are marked clear."""
        try:
            executor = self.daemon.targets.get(target).executor(next(iter(ended.values())))
        except (ApiError, KeyError):
            executor = None
        check = getattr(executor, "lingering", None)
        if check is None:
            self._clear.update(ended)
            return set()
        uids = {rid: r.owner_uid if r.owner_uid is not None else os.geteuid() for rid, r in ended.items()}
        found: set[str] = check(uids)
        devices = {g.id: g for g in self.of(target)}
        clear = [rid for rid in ended if rid not in found]
        # Where the vendor's tool lists compute processes (one call for them all): none of the
        # run's user's on its devices.
        busy = compute_pids([devices[d] for rid in clear for d in ended[rid].gpus if d in devices]) if clear else {}
        for rid in clear:
            pids = {pid for d in ended[rid].gpus for pid in busy.get(d, ())}
            if any(_uid_of(pid) == uids[rid] for pid in pids):
                found.add(rid)
        self._clear.update(set(ended) - found)
        return found

    async def _watch(self, target: str) -> None:
        """Look again until no ended run of `target` has a process left, then wake the queue."""
        try:
            while True:
                await anyio.sleep(LINGER_POLL)
                self.daemon.records.active()  # the runs that ended meanwhile are found
                ended = self._unclear_of(target)
                if not ended:
                    break
                still = await anyio.to_thread.run_sync(self._check, target, ended)
                if not still:
                    break
                log.info("gpus_wait_for_leftovers", target=target, runs=sorted(still))
        finally:
            self._watching.discard(target)
        if self.wake is not None:
            self.wake()

    def choose(self, record: RunRecord, held: dict[str, str], target: str | None = None) -> list[str] | None:
        """The devices to give a run now on its target (or on `target`), or None when they are not free."""
        gpus = self.of(target or record.target)
        free = [g.id for g in gpus if g.id not in held]
        wanted = self.wanted(record, target)
        if isinstance(wanted, list):
            return list(wanted) if all(w in free for w in wanted) else None
        return free[:wanted] if len(free) >= wanted else None

    def waiting_for(
        self,
        record: RunRecord,
        now: float | None = None,
        held: dict[str, str] | None = None,
        memo: GpuWords | None = None,
    ) -> str:
        """What a queued run waits for now, in words: the end of its retry's backoff, else its
        GPUs, naming the runs that hold them now (never one that has ended); `held`: the target's
        holders when the caller has them (a pass of the queue looks them up once, not per run),
        and `memo` the words it said for the same target and GPUs with those holders (thousands
        queued for one GPU are one sentence, made once)."""
        now = time.time() if now is None else now
        if record.not_before is not None and record.not_before > now:
            when = time.strftime("%H:%M:%S", time.localtime(record.not_before))
            return f"waiting until {when} (backoff)"
        wanted = self.wanted(record)
        if memo is None or held is None:
            return self._gpu_words(record.target, wanted, self.held(record.target) if held is None else held)
        key = (record.target, wanted if isinstance(wanted, int) else tuple(wanted))
        words = memo.get(key)
        if words is None:
            words = memo[key] = self._gpu_words(record.target, wanted, held)
        return words

    def _gpu_words(self, target: str, wanted: int | list[str], held: dict[str, str]) -> str:
        total = len(self.of(target))
        free = total - len(held)
        what = f"GPUs {','.join(wanted)}" if isinstance(wanted, list) else f"{wanted} GPU{'s' if wanted != 1 else ''}"
        holders = sorted(set(held.values()))
        by = f" (held by {', '.join(holders)})" if holders else ""
        return f"waiting for {what}: {free} of {total} free{by}"


def _uid_of(pid: int) -> int | None:
    """The user of a process of this machine (None: gone, or not in this pid namespace)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def queue_message(inventory: Inventory, record: RunRecord, why: str | None = None, waiting: str | None = None) -> str:
    """A queued run's message: why it is queued, when that is more than waiting (`why`, else a
    retry's "attempt 3 of 4"), then what it waits for now (`waiting`: other than its GPUs, such as
    the runs it waits for; else its backoff or its GPUs)."""
    waiting = waiting or inventory.waiting_for(record)
    if why is None and record.attempt > 1:
        why = f"attempt {record.attempt} of {record.retries + 1 + record.preemption.preemptions}"
    return f"{why}: {waiting}" if why else waiting
