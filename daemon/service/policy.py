"""The box's policy for each user of a shared daemon (`[policy]` in its config, docs/security.md).

A group member may queue at most `max_queued_runs_per_user` runs (so one backlog cannot take
the queue from everyone), and may give a `--priority` up to their limit only (0 by default: the
default priority, and any lower one), so no member can pause everyone else's runs for theirs
(docs/preemption.md). Root, the daemon's own user and the members of `admin_group` are not limited.
Checked where a run is asked for: start, resume, sweep (and a run file, which is one of those);
a retry or a paused run's way back is the same run again and is never refused. The cap's check
and the queuing it allows are one step (`admitted`): a user's requests that may queue runs are
taken one at a time, so two sweeps sent at once cannot both pass the check before either queued.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shlex
import weakref
from collections.abc import AsyncIterator
from typing import Protocol

import anyio
import structlog

from daemon.service.api import ApiError, Peer
from daemon.service.config import Config, PolicySection
from daemon.service.models import RunRecord
from daemon.service.records import Records

log = structlog.get_logger("obd.policy")

HIGHEST = 100
WHERE = "the daemon's config, [policy] (docs/security.md), which its administrator sets"


class PolicyHost(Protocol):
    """What the policy reads of the daemon: its configuration and its records."""

    config: Config
    records: Records


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_ids(peer: Peer) -> set[int]:
    """The caller's groups as the socket recorded them (as a login gives them where it cannot say)."""
    if peer.groups is not None:
        return {peer.gid, *peer.groups}
    try:
        return {peer.gid, *os.getgrouplist(pwd.getpwuid(peer.uid).pw_name, peer.gid)}
    except KeyError:
        return {peer.gid}


def in_group(peer: Peer, name: str) -> bool:
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        log.warning("policy_group_unknown", group=name, why="no such group on this machine: it grants nothing")
        return False
    return gid in group_ids(peer)


def unlimited(policy: PolicySection, peer: Peer) -> bool:
    """Root, the daemon's own user, and the members of the admin group."""
    if peer.is_root or peer.uid == os.geteuid():
        return True
    return policy.admin_group is not None and in_group(peer, policy.admin_group)


def priority_limit(policy: PolicySection, peer: Peer) -> int:
    """The highest priority this caller may give: the highest of `max_priority`, their own entry and
    the entries of their groups (all of it for root and the admins)."""
    if unlimited(policy, peer):
        return HIGHEST
    limits = [policy.max_priority]
    name = user_name(peer.uid)
    if name in policy.max_priority_users:
        limits.append(policy.max_priority_users[name])
    limits += [limit for group, limit in policy.max_priority_groups.items() if in_group(peer, group)]
    return max(limits)


def check_priority(policy: PolicySection, peer: Peer, priority: int, what: str) -> None:
    """Refuse a priority above the caller's limit, saying the limit, who sets it, and what to do."""
    if priority <= policy.max_priority:
        return  # the common case: what everyone may give (no look at the caller's groups)
    limit = priority_limit(policy, peer)
    if priority <= limit:
        return
    raise ApiError(
        f"{what} with --priority {priority} refused: {user_name(peer.uid)} may give a priority of at most {limit} "
        f"on this daemon (a higher one would pause other users' runs for it); the limit is in {WHERE}: "
        f"max_priority, max_priority_users, max_priority_groups, admin_group. Start it with --priority {limit} "
        "or lower, or ask the administrator",
        "denied",
    )


def check_resume_priority(policy: PolicySection, peer: Peer, source: RunRecord, command: list[str]) -> None:
    """A resume keeps its run's priority only if whoever resumes may give it (docs/preemption.md):
    else refused, saying the run's priority, the caller's limit, and the command that resumes it
    at a priority they may give (`obd train start --resume-from`, with `command`)."""
    if source.priority <= policy.max_priority:
        return
    limit = priority_limit(policy, peer)
    if source.priority <= limit:
        return
    wanted = source.gpus_wanted
    gpus = "" if wanted is None else f" --gpus {','.join(wanted) if isinstance(wanted, list) else wanted}"
    raise ApiError(
        f"obd train resume {source.id} refused: the run has priority {source.priority}, which a resume keeps, and "
        f"{user_name(peer.uid)} may give a priority of at most {limit} on this daemon (a higher one would pause "
        f"other users' runs for it); the limit is in {WHERE}: max_priority, max_priority_users, "
        f"max_priority_groups, admin_group. Resume it at a priority you may give: `obd train start --resume-from "
        f"{source.id} --priority {limit}{gpus} -- {shlex.join(command)}`, or ask the administrator",
        "denied",
    )


# --- which targets a user may use -------------------------------------------------------------


def owner_peer(uid: int | None) -> Peer:
    """A run's owner as a caller: their uid, their login's groups (for what the daemon does on its
    own for a run, an overflow, with no socket to read them from). None: the daemon's own user."""
    if uid is None:
        return Peer(uid=os.geteuid(), gid=os.getegid())
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = -1
    return Peer(uid=uid, gid=gid)


def restricted(policy: PolicySection, target: str) -> bool:
    """Whether `target` is kept for some users and groups (named in target_users or target_groups)."""
    return target in policy.target_users or target in policy.target_groups


def may_use(policy: PolicySection, peer: Peer, target: str) -> bool:
    """Whether this caller may run on `target`: every member may use a target the policy does not
    name; one it names, only the users and groups listed for it (and root, the daemon's user, the admins)."""
    if not restricted(policy, target) or unlimited(policy, peer):
        return True
    if user_name(peer.uid) in policy.target_users.get(target, []):
        return True
    return any(in_group(peer, group) for group in policy.target_groups.get(target, []))


def target_rule(policy: PolicySection, target: str) -> str:
    """Who may use `target`, as the config says it."""
    users = policy.target_users.get(target, [])
    groups = policy.target_groups.get(target, [])
    who = [*(f"user {u}" for u in users), *(f"the group {g}" for g in groups)]
    return (
        f"target {target} is only for {', '.join(who) if who else 'no one'} "
        f"(target_users / target_groups in {WHERE}), and the admins{' (' + policy.admin_group + ')' if policy.admin_group else ''}"
    )


def allowed_of(policy: PolicySection, peer: Peer, targets: list[str]) -> list[str]:
    return [t for t in targets if may_use(policy, peer, t)]


def check_target(policy: PolicySection, peer: Peer, target: str, what: str, others: list[str] | None = None) -> None:
    """Refuse `what` on a target this caller may not use, naming the rule and what to do."""
    if may_use(policy, peer, target):
        return
    usable = [t for t in (others or []) if t != target and may_use(policy, peer, t)]
    instead = f"use a target you may use ({', '.join(usable)})" if usable else "use another target"
    raise ApiError(
        f"{what} refused: {user_name(peer.uid)} may not use target {target}: {target_rule(policy, target)}. "
        f"{instead[0].upper() + instead[1:]}, or ask the administrator to add you to the rule",
        "denied",
    )


def queued_of(daemon: PolicyHost, uid: int) -> int:
    """How many runs of this user wait in the queue."""
    return daemon.records.queued_count(uid)


def check_queued(daemon: PolicyHost, peer: Peer, adding: int, what: str) -> None:
    """Refuse what would put the caller over their cap of queued runs, saying the cap and what to do."""
    policy = daemon.config.policy
    cap = policy.max_queued_runs_per_user
    if adding <= 0 or unlimited(policy, peer):
        return
    queued = queued_of(daemon, peer.uid)
    if queued + adding <= cap:
        return
    runs = f"its {adding} runs" if adding != 1 else "it"
    raise ApiError(
        f"{what} refused: {user_name(peer.uid)} has {queued} runs queued, and {runs} would make {queued + adding}, "
        f"over this daemon's cap of {cap} queued runs per user (max_queued_runs_per_user in {WHERE}). "
        "Cancel runs you no longer need (`obd train list --state queued`, `obd train cancel RUN|SWEEP`) or wait "
        "for some to start, then try again",
        "denied",
    )


# Each daemon's locks, one per capped user with a request under way (`admitted`).
_ADMITTING: weakref.WeakKeyDictionary[PolicyHost, dict[int, anyio.Lock]] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def admitted(daemon: PolicyHost, peer: Peer, priority: int, adding: int, what: str) -> AsyncIterator[None]:
    """Refuse a start, resume or sweep of `adding` runs at `priority` that the policy does not allow,
    and hold the check until the runs it admitted are queued (the block): the check and the queuing
    are one step for each capped user, whose other requests that may queue runs wait for it."""
    check_priority(daemon.config.policy, peer, priority, what)
    if adding <= 0 or unlimited(daemon.config.policy, peer):
        yield
        return
    locks = _ADMITTING.setdefault(daemon, {})
    lock = locks.setdefault(peer.uid, anyio.Lock())
    try:
        async with lock:
            check_queued(daemon, peer, adding, what)
            yield
    finally:
        if not lock.locked() and not lock.statistics().tasks_waiting:
            locks.pop(peer.uid, None)  # no lock kept per user who ever asked
