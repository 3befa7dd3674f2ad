"""``titan-fr analyze DUMP_DIR``: explain a hang from the Flight Recorder dumps of all ranks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_strategy.flight_recorder.analyze import diagnose, format_report
from titan_strategy.flight_recorder.dump import dump_dirs, read_dumps
from titan_strategy.flight_recorder.timeline import draw_timeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titan-fr", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="print a diagnosis and draw a timeline")
    analyze.add_argument("dump_dir", type=Path,
                         help="a run's dump folder, or any folder above it (the newest run found is taken)")
    analyze.add_argument("--png", type=Path, default=None, help="timeline picture (default DUMP_DIR/timeline.png)")
    analyze.add_argument("--last", type=int, default=30, help="ops per rank in the picture")
    analyze.add_argument("--stack-depth", type=int, default=6, help="innermost frames shown per rank")
    args = parser.parse_args(argv)

    if not args.dump_dir.is_dir():
        parser.error(f"{args.dump_dir} is not a folder; pass the FlightRecorder's dump_dir or a run folder in it")
    runs = list(dump_dirs(args.dump_dir))
    if not runs:
        parser.error(f"no Flight Recorder dumps (rank_N.json, nccl_trace_rank_N) in {args.dump_dir} or any folder "
                     f"under it: a clean run writes none")
    *older, run = runs
    if older:
        print(f"{len(runs)} runs' dumps under {args.dump_dir}; analysing the newest, {run}. The others, newest first:")
        print("".join(f"  {folder}\n" for folder in reversed(older)))
    diagnosis = diagnose(read_dumps(run))
    print(format_report(diagnosis, stack_depth=args.stack_depth))
    picture = draw_timeline(diagnosis, args.png or run / "timeline.png", last=args.last)
    print(f"\nTimeline of the last {args.last} ops per rank: {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
