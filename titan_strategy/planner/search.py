"""Enumerate the 4-D layouts a job admits, keep those that fit, rank them by estimated speed, and say why.

Placement rules (the TorchTitan paper's): TP stays within a node (it talks every layer), PP goes
across the slow links (it sends one activation per microbatch and stage boundary), CP comes in once
a sequence's activations no longer fit, and FSDP/HSDP takes whatever degree is left.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from titan_strategy.config import compiled_zero_bubble_problem
from titan_strategy.planner.estimate import RECOMPUTE, Estimate, Job, Layout, ModelShape, estimate

__all__ = ["Plan", "PlanError", "check_layout", "describe", "explain", "layout_problems", "plan_layouts",
           "ranking_score", "row_key"]

# Schedules the planner proposes; the others (GPipe, LoopedBFS, InterleavedZeroBubble, DualPipeV) are
# accepted by --check but never beat these in the model.
PROPOSED_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
_STAGES_PER_RANK = {"1F1B": 1, "GPipe": 1, "ZBVZeroBubble": 2, "DualPipeV": 2}


class PlanError(ValueError):
    """The request cannot be met; the message says why and what would."""


@dataclass(frozen=True)
class Plan:
    layout: Layout
    estimate: Estimate
    reasons: tuple[str, ...]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def layout_problems(shape: ModelShape, layout: Layout, job: Job) -> list[str]:
    """Why a layout cannot run at all (divisibility, placement, schedule), independent of memory."""
    problems = []
    if layout.world != job.gpus:
        problems.append(f"the degrees multiply to {layout.world}, not the {job.gpus} GPUs")
    for name, size in (("n_heads", shape.n_heads), ("n_kv_heads", shape.n_kv_heads), ("ffn_dim", shape.ffn_dim),
                       ("vocab_size", shape.vocab_size)):
        if size % layout.tp:
            problems.append(f"tp={layout.tp} does not divide {name}={size}")
    if layout.tp > job.gpus_per_node:
        problems.append(f"tp={layout.tp} spans nodes (gpus_per_node={job.gpus_per_node}); keep TP within a node")
    if job.seq_len % (2 * layout.cp * layout.tp):
        problems.append(f"seq_len={job.seq_len} must divide by 2 x cp x tp = {2 * layout.cp * layout.tp}")
    stages = layout.pp * layout.stages_per_rank
    if stages > shape.n_layers:
        problems.append(f"{stages} pipeline stages for {shape.n_layers} layers")
    sequences, remainder = divmod(job.global_batch_tokens, job.seq_len * layout.dp)
    if remainder or sequences < 1:
        problems.append(f"a global batch of {job.global_batch_tokens} tokens does not split into whole sequences "
                        f"of {job.seq_len} over dp={layout.dp}")
    elif sequences % layout.microbatches:
        problems.append(f"{sequences} sequences per data-parallel rank do not split into {layout.microbatches} "
                        "microbatches")
    if layout.pp > 1 and layout.microbatches < layout.pp and layout.schedule != "GPipe":
        problems.append(f"{layout.schedule} needs at least pp={layout.pp} microbatches, not {layout.microbatches}")
    if layout.float8 and not job.gpu.float8:
        problems.append(f"{job.gpu.name} has no float8 tensor cores")
    zero_bubble = compiled_zero_bubble_problem(job.compiled_blocks, layout.pp, layout.schedule)
    if zero_bubble:
        problems.append(zero_bubble)
    return problems


def _candidates(shape: ModelShape, job: Job) -> list[Layout]:
    nodes = max(job.gpus // job.gpus_per_node, 1)
    layouts = []
    for tp, cp, pp in itertools.product(_powers_of_two(job.gpus_per_node), _powers_of_two(job.gpus),
                                        _powers_of_two(min(job.gpus, shape.n_layers))):
        if job.gpus % (tp * cp * pp):
            continue
        dp = job.gpus // (tp * cp * pp)
        # HSDP replicates across nodes only when a shard group still fills at least a node.
        replicates = {1} | {r for r in _powers_of_two(nodes) if dp % r == 0 and dp // r * tp * cp >= job.gpus_per_node}
        sequences = job.global_batch_tokens // max(job.seq_len * dp, 1)
        # More microbatches shrink the bubble but also each matmul: try pp, 2pp, 4pp, ... that divide the batch.
        microbatch_counts = [m for m in (pp * 2**i for i in range(12)) if m <= sequences and sequences % m == 0] \
            if pp > 1 else [1]
        for replicate, schedule, microbatches, ac, float8 in itertools.product(
                sorted(replicates), PROPOSED_SCHEDULES if pp > 1 else (None,), microbatch_counts,
                ("none", "selective_op", "full"), (False, True) if job.gpu.float8 else (False,)):
            stages_per_rank = _STAGES_PER_RANK.get(schedule, 2) if schedule else 1
            layouts.append(Layout(dp_replicate=replicate, dp_shard=dp // replicate, tp=tp, cp=cp, pp=pp,
                                  schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
                                  ac=ac, float8=float8))
    return layouts


def explain(layout: Layout, job: Job, shape: ModelShape) -> tuple[str, ...]:
    """One line per choice, in the paper's terms."""
    reasons = []
    if layout.tp > 1:
        reasons.append(f"TP{layout.tp} within a node: its per-layer collectives need NVLink, and it cuts each rank's "
                       "activations and FSDP group size")
    if layout.pp > 1:
        reasons.append(f"PP{layout.pp} ({layout.schedule}, {layout.microbatches} microbatches) "
                       "across the slowest links: one activation per stage boundary")
    if layout.cp > 1:
        reasons.append(f"CP{layout.cp}: a {job.seq_len}-token sequence's activations do not fit on fewer ranks")
    if layout.dp_replicate > 1:
        reasons.append(f"HSDP {layout.dp_replicate}x{layout.dp_shard}: shards stay within {layout.dp_shard} ranks, "
                       "replicas all-reduce across nodes")
    else:
        reasons.append(f"FSDP{layout.dp_shard} over what is left")
    if layout.ac != "none":
        reasons.append(f"AC {layout.ac}: without it the activations do not fit (or it costs less than it frees)")
    if layout.float8:
        reasons.append("float8 linears: faster matmuls and half-size all-gathers")
    return tuple(reasons)


def check_layout(shape: ModelShape, layout: Layout, job: Job) -> Plan:
    """Estimate one given layout; ``PlanError`` if it cannot run or does not fit, naming the nearest layout that
    does."""
    problems = layout_problems(shape, layout, job)
    result = estimate(shape, layout, job) if not problems else None
    if result is not None and result.memory_gib > job.gpu.memory_gib:
        problems.append(f"it needs {result.memory_gib:.1f} GiB per GPU, more than the {job.gpu.memory_gib:g} GiB of "
                        f"a {job.gpu.name}")
    if problems:
        nearest = _nearest(shape, layout, job)
        hint = f"; the nearest layout that fits: {describe(nearest.layout)}" if nearest else ""
        raise PlanError("The layout cannot run: " + "; ".join(problems) + hint)
    assert result is not None
    return Plan(layout, result, explain(layout, job, shape))


def _nearest(shape: ModelShape, layout: Layout, job: Job) -> Plan | None:
    def distance(other: Layout) -> int:
        return sum(getattr(layout, k) != getattr(other, k) for k in ("tp", "cp", "pp", "dp_replicate", "ac", "float8"))

    plans = _feasible(shape, job)
    return min(plans, key=lambda plan: (distance(plan.layout), plan.estimate.step_s)) if plans else None


def _feasible(shape: ModelShape, job: Job) -> list[Plan]:
    """Layouts that run, fit, and follow the paper's placement rules.

    PP only across nodes: a stage holds at least a node's GPUs. CP only for long sequences (above
    ``CP_MIN_SEQ_LEN``), or where nothing fits without it.
    """
    plans = []
    for layout in _candidates(shape, job):
        if layout_problems(shape, layout, job) or (layout.pp > 1 and job.gpus // layout.pp < job.gpus_per_node):
            continue
        result = estimate(shape, layout, job)
        if result.memory_gib <= job.gpu.memory_gib:
            plans.append(Plan(layout, result, explain(layout, job, shape)))
    if job.seq_len <= CP_MIN_SEQ_LEN and any(plan.layout.cp == 1 for plan in plans):
        plans = [plan for plan in plans if plan.layout.cp == 1]
    return plans


def plan_layouts(shape: ModelShape, job: Job, top: int = 10) -> list[Plan]:
    """The feasible layouts, fastest first; ``PlanError`` if none fits."""
    if job.gpus < 1 or job.gpus_per_node < 1:
        raise PlanError(f"gpus={job.gpus} and gpus_per_node={job.gpus_per_node} must be >= 1.")
    if job.gpus > job.gpus_per_node and job.gpus % job.gpus_per_node:
        raise PlanError(f"gpus={job.gpus} is not a multiple of gpus_per_node={job.gpus_per_node}: every node must "
                        "hold the same number of ranks.")
    plans = _feasible(shape, job)
    if not plans:
        params_gib = shape.num_params() * 16 / 2**30
        raise PlanError(
            f"No layout of {job.gpus} x {job.gpu.name} ({job.gpu.memory_gib:g} GiB) fits this model at seq_len "
            f"{job.seq_len} and {job.global_batch_tokens} tokens per step, even at the largest degrees and full AC "
            f"(weights, gradients and AdamW state alone are {params_gib:,.0f} GiB); use more GPUs, larger GPUs, or "
            "a smaller batch or sequence.")
    plans.sort(key=_rank_key)
    # One row per parallel layout (degrees and schedule), with its best HSDP split of the data-parallel degree and
    # its best microbatch, AC and float8 choice: the splits of one degree differ by a percent or two, and rows of
    # near-copies would push the other layouts out of view.
    best: dict[tuple, Plan] = {}
    for plan in plans:
        best.setdefault(row_key(plan.layout), plan)
    return list(best.values())[:top]


# Below this, a sequence is split over ranks only if nothing else fits: CP's ring costs latency per layer,
# and short shards make small attention kernels. The TorchTitan paper uses CP from 32k tokens on.
CP_MIN_SEQ_LEN = 16384
# Each parallel dimension beyond FSDP must promise this much more speed to rank above a layout without
# it: the estimates are good to some percent, and every dimension adds its own failure modes.
DIMENSION_MARGIN = 0.05


def row_key(layout: Layout) -> tuple:
    """What one row of the ranking stands for: the parallel degrees and the schedule."""
    return layout.dp, layout.tp, layout.cp, layout.pp, layout.schedule


def ranking_score(plan: Plan) -> float:
    """Estimated tokens/s per GPU, less ``DIMENSION_MARGIN`` per parallel dimension beyond FSDP."""
    layout = plan.layout
    dimensions = sum(d > 1 for d in (layout.tp, layout.cp, layout.pp, layout.dp_replicate))
    return plan.estimate.tokens_per_s_per_gpu * (1 - DIMENSION_MARGIN * dimensions)


def _rank_key(plan: Plan) -> tuple:
    # Within 0.5%, the simpler wins: no float8, less recomputation.
    return (-float(f"{ranking_score(plan):.3g}"), plan.layout.float8, RECOMPUTE[plan.layout.ac])


def describe(layout: Layout) -> str:
    parts = [f"dp_replicate={layout.dp_replicate}", f"dp_shard={layout.dp_shard}", f"tp={layout.tp}",
             f"cp={layout.cp}", f"pp={layout.pp}"]
    if layout.pp > 1:
        parts += [f"schedule={layout.schedule}", f"microbatches={layout.microbatches}"]
    return ", ".join(parts + [f"ac={layout.ac}", f"float8={layout.float8}"])
