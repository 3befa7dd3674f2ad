"""``titan report RUN_DIR [--png out.png]``: one picture of a run from its logs, for people without TensorBoard.

Reads the newest TensorBoard event file under ``RUN_DIR`` (at any depth; Lightning's CSVLogger's
``metrics.csv`` too) and draws four panels against the optimizer step: train and validation loss; tokens/s
per device and MFU; peak memory; learning rate and gradient norm. Every complete checkpoint under ``RUN_DIR``
whose name carries its step (``ModelCheckpoint``'s ``...step=N.ckpt``) is marked on each panel.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict
from pathlib import Path

from titan_strategy.checkpoint.manifest import is_complete

__all__ = ["draw_report", "main", "read_scalars"]

Series = dict[str, list[tuple[int, float]]]  # tag -> (step, value), in step order
# (panel title, left-axis tags, right-axis tags); a tag prefix ends with "*".
PANELS = [
    ("loss", ["train_loss", "val_loss"], []),
    ("throughput", ["throughput/tokens_per_s_per_device"], ["throughput/mfu_percent"]),
    ("peak memory (GiB)", ["memory/peak_allocated_gib", "memory/peak_reserved_gib", "memory/host_peak_rss_gib"], []),
    ("optimizer", ["lr-*"], ["grad_norm"]),
]


def _newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda path: path.stat().st_mtime) if paths else None


def read_scalars(run_dir: Path) -> tuple[Series, Path]:
    """Every scalar of the run's newest log under ``run_dir``, and that log's path.

    Raises:
        FileNotFoundError: no TensorBoard event file and no metrics.csv under ``run_dir``.
    """
    log = _newest([*run_dir.rglob("events.out.tfevents.*"), *run_dir.rglob("metrics.csv")])
    if log is None:
        raise FileNotFoundError(f"no TensorBoard event file or metrics.csv under {run_dir}: point at a run's "
                                "default_root_dir, or log with TensorBoardLogger (the shipped configs do)")
    series: Series = defaultdict(list)
    if log.name == "metrics.csv":
        with log.open() as rows:
            for row in csv.DictReader(rows):
                for tag, value in row.items():
                    if tag not in ("step", "epoch") and value not in ("", None):
                        series[tag].append((int(row["step"]), float(value)))
    else:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(log), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        for tag in events.Tags()["scalars"]:
            series[tag] = [(event.step, event.value) for event in events.Scalars(tag)]
    return {tag: sorted(points) for tag, points in series.items()}, log


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints under ``run_dir`` whose names carry them."""
    steps = {int(match.group(1)) for path in run_dir.rglob("*.ckpt")
             if (match := re.search(r"step=(\d+)", path.name)) and path.is_dir() and is_complete(path)}
    return sorted(steps)


def _tags(series: Series, wanted: list[str]) -> list[str]:
    return [tag for pattern in wanted for tag in sorted(series)
            if (tag.startswith(pattern[:-1]) if pattern.endswith("*") else tag == pattern)]


def draw_report(series: Series, saves: list[int], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(13, 8), constrained_layout=True)
    for axis, (name, left, right) in zip(axes.flat, PANELS):
        drawn = []
        for tags, side, style in ((_tags(series, left), axis, "-"), (_tags(series, right), None, "--")):
            if not tags:
                continue
            target = side if side is not None else axis.twinx()  # the right-hand tags get an axis of their own
            for tag in tags:
                steps, values = zip(*series[tag])
                marker = "o" if len(steps) < 20 else None
                drawn += target.plot(steps, values, style, color=f"C{len(drawn)}", marker=marker, markersize=4,
                                     label=tag + (" (right axis)" if side is None else ""))
        for step in saves:
            axis.axvline(step, color="grey", linestyle=":", linewidth=1)
        axis.set_title(name + (f"  (dotted: checkpoints at steps {', '.join(map(str, saves))})" if saves else ""),
                       fontsize=10)
        axis.set_xlabel("step")
        if drawn:
            axis.legend(drawn, [line.get_label() for line in drawn], fontsize=8, loc="best")
        else:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes, color="grey")
    figure.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titan report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's default_root_dir, or any folder above its logs")
    parser.add_argument("--png", type=Path, default=None, help="the picture (default RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        parser.error(f"{args.run_dir} is not a folder; pass the run's default_root_dir")
    try:
        series, log = read_scalars(args.run_dir)
    except FileNotFoundError as error:
        parser.error(str(error))
    saves = checkpoint_steps(args.run_dir)
    picture = draw_report(series, saves, f"{args.run_dir}: {log.parent.relative_to(args.run_dir)}",
                          args.png or args.run_dir / "report.png")
    for tag in ("train_loss", "val_loss"):
        if series.get(tag):
            (first_step, first), (last_step, last) = series[tag][0], series[tag][-1]
            print(f"{tag}: {first:.3f} at step {first_step} -> {last:.3f} at step {last_step}")
    print(f"{len(series)} series from {log}; checkpoints at steps {saves or 'none'}\nPicture: {picture}")
    return 0
