"""Explain a hang from every rank's Flight Recorder dump: which rank, which collective, where.

Collectives on one process group are numbered per group (``collective_seq_id``); every member must
issue the same op at the same number. Two things go wrong:

- **lag**: some members never issued number N (they are stuck elsewhere, or dead);
- **mismatch**: all issued number N but not the same op. That is what a *skipped* collective looks
  like: the skipper's next op lands on the number the others spend on the skipped one. Training
  repeats itself every step, so the op that was due at N is the one that followed the same recent ops
  earlier in the trace; the ranks that issued something else skipped it.

Of all groups' problems, the cause is the one that some rank's departure from its *own* step pattern
explains: the op due on that group is the one it skipped. Without such a rank, it is the problem whose
wait began first. The others follow from it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from titan_strategy.flight_recorder.dump import RankDump

__all__ = ["Diagnosis", "GroupProblem", "Op", "P2PState", "diagnose", "format_report", "ops_of", "unmatched_p2p"]

_CONTEXT = 8  # how many preceding ops identify the place in the step
_HISTORY = 4096  # how far back the pattern is searched (a few steps of a large model)
_WINDOW = 16  # how many of a rank's newest collectives are checked against its own pattern


@dataclass(frozen=True)
class Op:
    """One recorded collective or p2p op of one rank, backend-neutral."""

    rank: int
    group: str
    seq: int
    name: str  # all_reduce, all_gather, send, recv, ...
    sizes: tuple
    dtypes: tuple
    created_ns: int
    completed: bool | None  # None: the backend does not say (gloo collectives)
    peer: int | None = None  # p2p: the other side's global rank
    frames: tuple[str, ...] = ()

    @property
    def signature(self) -> tuple:
        return self.name, self.sizes

    def describe(self) -> str:
        sizes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.sizes) or "no tensors"
        dtypes = ",".join(sorted(set(self.dtypes)))
        return f"{self.name} [{sizes}]{' ' + dtypes if dtypes else ''}"


def _group_ranks(dumps: dict[int, RankDump]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for dump in dumps.values():
        for name, config in dump.pg_config.items():
            if name and config.get("ranks") not in (None, "", "[]"):
                ranks = config["ranks"]
                groups[name] = {"desc": config.get("desc", ""),
                                "ranks": json.loads(ranks) if isinstance(ranks, str) else list(ranks)}
    return groups


def ops_of(dump: RankDump, groups: dict[str, dict[str, Any]]) -> list[Op]:
    """The dump's entries as ``Op``s (p2p peers turned into global ranks), oldest first."""
    ops = []
    for entry in dump.entries:
        group = str(entry.get("process_group", [entry.get("pg_id")])[0])
        backend, _, title = str(entry.get("profiling_name", "")).partition(":")
        name, _, pair = title.partition(" ")
        state = entry.get("state")
        completed = True if state == "completed" else None if backend == "gloo" and not entry.get("is_p2p") else False
        peer = None
        if entry.get("is_p2p") and "->" in pair and group in groups:
            src, dst = (int(r) for r in pair.split("->"))
            ranks = groups[group]["ranks"]
            peer = ranks[dst] if name == "send" else ranks[src]
        frames = tuple(f"{f.get('filename')}:{f.get('line')} in {f.get('name')}" for f in entry.get("frames") or [])
        ops.append(Op(rank=dump.rank, group=group, name=name,
                      seq=int(entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"]),
                      sizes=tuple(tuple(s) for s in entry.get("input_sizes") or []),
                      dtypes=tuple(str(d) for d in entry.get("input_dtypes") or []),
                      created_ns=int(entry.get("time_created_ns", 0)), completed=completed, peer=peer, frames=frames))
    return sorted(ops, key=lambda op: op.created_ns)


@dataclass
class GroupProblem:
    """The first collective of one process group that its members did not all issue alike."""

    group: str
    desc: str
    ranks: list[int]
    seq: int
    expected: Op  # the op that was due, as a rank that issued it recorded it
    missing: list[int]  # members that did not issue ``expected`` at ``seq``
    issued_instead: dict[int, Op] = field(default_factory=dict)  # missing members that issued another op there
    waiting_since_ns: int = 0

    def summary(self) -> str:
        instead = "".join(f"; rank {r} issued {op.describe()} in its place" for r, op in self.issued_instead.items())
        return (f"ranks {self.missing} never issued collective #{self.seq} {self.expected.describe()} on process "
                f"group {self.group} ({self.desc or 'no description'}, ranks {self.ranks}){instead}")


@dataclass
class P2PState:
    """A pipeline rank's point-to-point progress."""

    rank: int
    last_send: Op | None
    last_recv: Op | None
    pending: list[Op]


@dataclass
class Diagnosis:
    """What ``diagnose`` found in one run's dumps."""

    ranks: list[int]
    world_size: int | None
    no_dump: list[int]
    problems: list[GroupProblem]  # the likely cause first
    departures: dict[int, tuple[Op, tuple]]  # rank -> (its op that broke its pattern, the (group, name, sizes) due)
    p2p: list[P2PState]
    progress: dict[str, dict[int, int]]  # group -> rank -> last collective number issued
    stacks: dict[int, list[str]]
    reasons: dict[int, str]
    coordinates: dict[int, dict[str, int]]
    ops: dict[int, list[Op]]  # every rank's recorded ops, oldest first
    dumped_ns: dict[int, int]  # when each rank dumped


def _next_after(history: list[tuple], min_width: int = 1) -> tuple | None:
    """What followed ``history``'s last ops the latest time they occurred before (longest match first)."""
    history = history[-_HISTORY:]
    for width in range(min(_CONTEXT, len(history) - 1), min_width - 1, -1):
        context = history[-width:]
        for end in range(len(history) - 1, width - 1, -1):
            if history[end - width:end] == context:
                return history[end]
    return None


def _predicted(agreed: list[tuple], ranks_ops: dict[int, Op]) -> tuple | None:
    """The op due after ``agreed``: what followed the same last few ops earlier, or the majority's op."""
    due = _next_after(agreed)
    if due is not None:
        return due
    votes: dict[tuple, int] = defaultdict(int)
    for op in ranks_ops.values():
        votes[op.signature] += 1
    best = max(votes.values())
    leaders = [sig for sig, count in votes.items() if count == best]
    return leaders[0] if len(leaders) == 1 else None


def _group_problem(name: str, config: dict[str, Any], by_rank: dict[int, dict[int, Op]],
                   last: dict[int, int]) -> GroupProblem | None:
    members = [r for r in config["ranks"] if r in by_rank]
    if len(members) < 2:
        return None
    common = min(last[r] for r in members)
    # Mismatch: the first number all members issued but not alike.
    for seq in sorted(set.intersection(*(set(by_rank[r]) for r in members))):
        ops = {r: by_rank[r][seq] for r in members}
        if len({op.signature for op in ops.values()}) > 1:
            reference = by_rank[members[0]]
            agreed = [reference[s].signature for s in sorted(reference) if s < seq]
            due = _predicted(agreed, ops)
            on_track = [r for r in members if ops[r].signature == due]
            if not on_track:  # cannot tell who deviated: report every member against the first
                on_track = [members[0]]
            off = [r for r in members if r not in on_track]
            return GroupProblem(group=name, desc=config["desc"], ranks=config["ranks"], seq=seq,
                                expected=ops[on_track[0]], missing=off, issued_instead={r: ops[r] for r in off},
                                waiting_since_ns=min(ops[r].created_ns for r in on_track))
    ahead = [r for r in members if last[r] > common]
    if not ahead:
        return None
    seq = common + 1
    issued = [r for r in ahead if seq in by_rank[r]]
    if not issued:
        return None
    return GroupProblem(group=name, desc=config["desc"], ranks=config["ranks"], seq=seq,
                        expected=by_rank[issued[0]][seq], missing=[r for r in members if last[r] < seq],
                        waiting_since_ns=min(by_rank[r][seq].created_ns for r in issued))


def _departure(ops: list[Op]) -> tuple[Op, tuple] | None:
    """The first of a rank's newest collectives that breaks the pattern of its own earlier ones, with the
    ``(group, name, sizes)`` that was due there; None if the rank kept to its pattern."""
    collectives = [op for op in ops if op.name not in ("send", "recv")]
    signatures = [(op.group, *op.signature) for op in collectives]
    for index in range(max(_CONTEXT + 1, len(collectives) - _WINDOW), len(collectives)):
        due = _next_after(signatures[:index], min_width=2)
        if due is not None and due != signatures[index]:
            return collectives[index], due
    return None


def diagnose(dumps: dict[int, RankDump]) -> Diagnosis:
    groups = _group_ranks(dumps)
    ops = {rank: ops_of(dump, groups) for rank, dump in dumps.items()}
    world_sizes = {d.titan.get("world_size") for d in dumps.values()} - {None}
    world_size = max(world_sizes) if world_sizes else max((max(g["ranks"]) + 1 for g in groups.values()), default=None)
    problems, progress = [], {}
    for name, config in groups.items():
        by_rank = {r: {op.seq: op for op in ops[r] if op.group == name and op.peer is None and op.name not in
                       ("send", "recv")} for r in config["ranks"] if r in dumps}
        last = {r: max([*seqs, int(dumps[r].pg_status.get(name, {}).get("last_enqueued_collective", 0))])
                for r, seqs in by_rank.items()}
        if len(set(last.values())) > 1:
            progress[name] = last
        problem = _group_problem(name, config, by_rank, last)
        if problem is not None:
            problems.append(problem)
    # The cause is the problem that a rank's departure from its own pattern explains (it was due on that
    # group and did not come); without one, the problem whose wait began first. Timing alone misleads
    # when waits begin milliseconds apart on a loaded machine.
    # A departure counts only where it explains a problem: a rare op (a first validation batch, a save)
    # breaks the pattern too.
    departures = {rank: found for rank in dumps if (found := _departure(ops[rank])) is not None
                  and any(found[1][0] == p.group and rank in p.missing for p in problems)}
    problems.sort(key=lambda p: (not any(departures[r][1][0] == p.group for r in p.missing if r in departures),
                                 p.waiting_since_ns))
    return Diagnosis(
        ranks=sorted(dumps), world_size=world_size, no_dump=sorted(set(range(world_size or 0)) - set(dumps)),
        problems=problems, departures=departures, progress=progress,
        p2p=[state for rank in sorted(dumps) if (state := _p2p_state(rank, ops[rank])) is not None],
        # NCCL's own dumps carry no stack of ours: the frames recorded with the newest op stand in.
        stacks={r: d.titan.get("python_stack") or (list(ops[r][-1].frames[::-1]) if ops[r] else [])
                for r, d in dumps.items()},
        reasons={r: d.titan.get("reason", d.source) for r, d in dumps.items()},
        coordinates={r: d.titan.get("coordinates", {}) for r, d in dumps.items()}, ops=ops,
        dumped_ns={r: int(d.titan.get("time_ns", 0)) or max((op.created_ns for op in ops[r]), default=0)
                   for r, d in dumps.items()})


def _p2p_state(rank: int, ops: list[Op]) -> P2PState | None:
    p2p = [op for op in ops if op.name in ("send", "recv")]
    if not p2p:
        return None
    done = {kind: [op for op in p2p if op.name == kind and op.completed] for kind in ("send", "recv")}
    return P2PState(rank=rank, last_send=done["send"][-1] if done["send"] else None,
                    last_recv=done["recv"][-1] if done["recv"] else None,
                    pending=[op for op in p2p if not op.completed])


def unmatched_p2p(diagnosis: Diagnosis) -> list[str]:
    """Pending sends/receives whose peer posted nothing towards them: that peer stalled before it."""
    states = {state.rank: state for state in diagnosis.p2p}
    found = []
    for state in diagnosis.p2p:
        for op in state.pending:
            peer = states.get(op.peer) if op.peer is not None else None
            if peer is None or any(other.peer == state.rank for other in peer.pending):
                continue
            wanted = "send" if op.name == "recv" else "recv"
            last = peer.last_send if wanted == "send" else peer.last_recv
            found.append(f"{_who(diagnosis, state.rank)} waits in {_p2p_line(op)}, but rank {op.peer} never posted "
                         f"the matching {wanted} (its last completed {wanted}: {_p2p_line(last)}); rank {op.peer} "
                         f"stalled before it, see its stack")
    return found


def _who(diagnosis: Diagnosis, rank: int) -> str:
    coords = diagnosis.coordinates.get(rank) or {}
    place = " ".join(f"{dim}{index}" for dim, index in coords.items())
    return f"rank {rank}" + (f" ({place})" if place else "")


def _p2p_line(op: Op | None) -> str:
    if op is None:
        return "none"
    arrow = "to" if op.name == "send" else "from"
    return f"#{op.seq} {op.name} {arrow} rank {op.peer} {op.describe().split(' ', 1)[1]}"


def format_report(diagnosis: Diagnosis, stack_depth: int = 6) -> str:
    """The text ``titan-fr analyze`` prints."""
    lines = [f"Flight Recorder dumps from {len(diagnosis.ranks)} of {diagnosis.world_size} ranks."]
    if diagnosis.no_dump:
        lines.append(f"  no dump from ranks {diagnosis.no_dump}: they died first, or never noticed the hang")
    for rank in diagnosis.ranks:
        lines.append(f"  {_who(diagnosis, rank)}: {diagnosis.reasons[rank][:160]}")
    lines.append("")
    if diagnosis.problems:
        cause = diagnosis.problems[0]
        lines.append(f"Likely cause: {cause.summary()}.")
        for problem in diagnosis.problems[1:]:
            lines.append(f"  then: {problem.summary()}")
    elif unmatched := unmatched_p2p(diagnosis):
        lines.extend(f"Likely cause: {line}." for line in unmatched)
    elif not diagnosis.p2p:
        lines.append("Every process group's members issued the same collectives: no collective is missing.")
    for rank, (op, (group, name, _)) in sorted(diagnosis.departures.items()):
        lines.append(f"  {_who(diagnosis, rank)} left its own step pattern: it issued #{op.seq} {op.describe()} on "
                     f"group {op.group} where {name} on group {group} was due")
    if diagnosis.progress:
        lines.append("")
        lines.append("Progress (last collective number issued per process group):")
        for group, last in diagnosis.progress.items():
            top = max(last.values())
            behind = ", ".join(f"rank {r} {top - n} behind" for r, n in sorted(last.items()) if n < top)
            lines.append(f"  group {group}: " + ", ".join(f"rank {r} #{n}" for r, n in sorted(last.items()))
                         + (f" ({behind})" if behind else ""))
    if diagnosis.p2p:
        lines.append("")
        lines.append("Pipeline point-to-point (last completed per stage):")
        for state in diagnosis.p2p:
            lines.append(f"  {_who(diagnosis, state.rank)}: send {_p2p_line(state.last_send)}; "
                         f"recv {_p2p_line(state.last_recv)}")
            for op in state.pending:
                lines.append(f"      not completed: {_p2p_line(op)}")
    lines.append("")
    lines.append("Python stacks at the dump (innermost last):")
    for rank in diagnosis.ranks:
        lines.append(f"  {_who(diagnosis, rank)}:")
        lines.extend(f"      {frame}" for frame in diagnosis.stacks[rank][-stack_depth:])
    return "\n".join(lines)
