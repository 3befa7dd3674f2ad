"""A picture of the last ops of every rank before the dump, for people who would rather look than read."""

from __future__ import annotations

from pathlib import Path

from titan_strategy.flight_recorder.analyze import Diagnosis

__all__ = ["draw_timeline"]

_COLOURS = {"send": "tab:green", "recv": "tab:orange"}


def draw_timeline(diagnosis: Diagnosis, path: Path, last: int = 30) -> Path:
    """One row per rank, its ``last`` ops in order, newest on the right, each a box labelled
    ``name#seq group``. The newest op is red if it never completed (with how long it had waited); the
    ops of the likely cause's group are outlined in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cause = diagnosis.problems[0] if diagnosis.problems else None
    ranks = sorted(diagnosis.ops)
    figure, axes = plt.subplots(figsize=(max(8.0, 0.42 * last + 2), 1.1 * len(ranks) + 1.4))
    for row, rank in enumerate(ranks):
        ops = diagnosis.ops[rank][-last:]
        for index, op in enumerate(ops):
            x = last - len(ops) + index
            stuck = index == len(ops) - 1 and op.completed is not True
            in_cause = cause is not None and op.group == cause.group and op.name not in ("send", "recv")
            axes.add_patch(plt.Rectangle((x, row - 0.4), 0.92, 0.8, linewidth=1.4 if in_cause else 0.3,
                                         facecolor="tab:red" if stuck else _COLOURS.get(op.name, "tab:blue"),
                                         edgecolor="black" if in_cause else "white"))
            label = f"{op.name}#{op.seq} g{op.group}"
            if stuck:
                label += f"\n{(diagnosis.dumped_ns[rank] - op.created_ns) / 1e9:.1f} s"
            axes.text(x + 0.46, row, label, rotation=90, ha="center", va="center", fontsize=6, color="white")
    axes.set_xlim(-0.2, last + 0.2)
    axes.set_ylim(len(ranks) - 0.4, -0.6)
    axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axes.set_xticks([])
    axes.set_xlabel(f"last {last} ops per rank, oldest to newest (blue: collective, green: send, orange: recv, "
                    f"red: newest, never completed)", fontsize=8)
    title = "Flight Recorder timeline"
    if cause is not None:
        title += (f" - likely cause: ranks {cause.missing} never issued #{cause.seq} {cause.expected.name} on "
                  f"group {cause.group} (outlined)")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
