"""The planner's answer as a table (text) and as memory-breakdown bars (PNG)."""

from __future__ import annotations

from pathlib import Path

from titan_strategy.planner.estimate import Job
from titan_strategy.planner.search import Plan

__all__ = ["format_plans", "save_memory_png"]

# Where the memory estimate missed a rehearsed rank by far more than 10% (benchmarks/RESULTS.md, "Rehearsals"):
# the 405B FSDP4 x TP8 x PP16 Interleaved1F1B rank with selective_op AC held 113 GiB, 38% above the estimate.


_PARTS = ("parameters", "gradients", "optimizer", "bf16_weights", "unsharded_gradients", "pipeline_buffers",
          "activations", "logits_loss", "recompute_window")


def _layout_cells(plan: Plan) -> list[str]:
    layout = plan.layout
    schedule = f"{layout.schedule} x{layout.microbatches}" if layout.pp > 1 else "—"
    return [str(layout.dp_replicate), str(layout.dp_shard), str(layout.tp), str(layout.cp), str(layout.pp), schedule,
            layout.ac, "yes" if layout.float8 else "no"]


def format_plans(plans: list[Plan], job: Job, save_window_s: float) -> str:
    """A ranked table, then one line per choice of the best layout."""
    header = ["#", "dp_rep", "dp_shard", "tp", "cp", "pp", "schedule", "AC", "float8", "tokens/s/GPU", "step s",
              "GiB/GPU", "params+grads+optim", "activations", "logits", "ckpt GiB/rank", "write GB/s"]
    rows = []
    for index, plan in enumerate(plans, start=1):
        e, m = plan.estimate, plan.estimate.memory
        # The whole job's checkpoint in the save window: every rank writes its shard at once.
        write_gbps = e.checkpoint_gib_per_rank * 2**30 * job.gpus / save_window_s / 1e9
        rows.append([str(index), *_layout_cells(plan), f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.step_s:.2f}",
                     f"{e.memory_gib:.1f}",
                     f"{m['parameters'] + m['gradients'] + m['optimizer']:.1f}",
                     f"{m['activations']:.1f}", f"{m['logits_loss']:.1f}", f"{e.checkpoint_gib_per_rank:.2f}",
                     f"{write_gbps:.1f}"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    best = plans[0]
    lines += ["", f"Why #1 ({job.gpus} x {job.gpu.name}, {job.gpu.memory_gib:g} GiB):",
              *(f"  - {reason}" for reason in best.reasons),
              "  step time: " + ", ".join(f"{name} {value:.2f} s" for name, value in best.estimate.time.items()
                                          if value > 0.005 and name != "step"),
              f"Checkpoint write bandwidth assumes the whole job's save lands in {save_window_s:g} s."]
    return "\n".join(lines)


def _short_name(plan: Plan) -> str:
    layout = plan.layout
    data = f"hsdp{layout.dp_replicate}x{layout.dp_shard}" if layout.dp_replicate > 1 else f"fsdp{layout.dp_shard}"
    return "x".join([data, *(f"{name}{value}" for name, value in (("tp", layout.tp), ("cp", layout.cp),
                                                                  ("pp", layout.pp)) if value > 1)])


def save_memory_png(plans: list[Plan], job: Job, path: Path) -> Path:
    """Stacked bars of each layout's memory parts, with the device's capacity as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(plans) + 2), 4.5))
    labels = [f"#{i}\n{_short_name(plan)}" for i, plan in enumerate(plans, start=1)]
    bottoms = [0.0] * len(plans)
    for part in _PARTS:
        values = [plan.estimate.memory[part] for plan in plans]
        axes.bar(labels, values, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axes.scatter(labels, [plan.estimate.memory_gib for plan in plans], marker="_", s=600, color="black",
                 label="estimated need (peak + headroom)", zorder=3)
    axes.axhline(job.gpu.memory_gib, color="red", linestyle="--", label=f"{job.gpu.name} memory")
    axes.set_ylabel("GiB per GPU (gradients and activations do not peak together)")
    axes.set_title(f"Top layouts on {job.gpus} x {job.gpu.name}, seq {job.seq_len}")
    axes.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
