"""Summarize torchtitan step log lines (benchmark anchor kit).

    python3 summarize.py LOG LABEL [FIRST_STEP] [LAST_STEP]

torchtitan v0.2.2 (components/metrics.py, MetricsProcessor.log) prints, per logged step:
  step: 11  loss:  9.87654  grad_norm:  1.2345  memory: 41.23GiB(29.44%)  tps: 12,345  tflops: 131.30  mfu: 13.28%
(memory = max_reserved since the previous log line; tps = tokens per second per device,
wall-clock between log lines, data loading included).  Prints exactly one line:
  LABEL: median tps over steps 11-30 = N, peak memory = M GiB (...)
"""

import re
import statistics
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(
    r"step:\s*(\d+)\s.*?memory:\s*(-?[\d.]+)GiB.*?tps:\s*([\d,]+)"
    r"(?:.*?tflops:\s*([\d,.]+))?(?:.*?mfu:\s*([\d.]+)%)?"
)


def main() -> int:
    path, label = sys.argv[1], sys.argv[2]
    first = int(sys.argv[3]) if len(sys.argv) > 3 else 11
    last = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    rows = {}
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        print(f"{label}: no log ({e})")
        return 1
    for line in ANSI.sub("", text).splitlines():
        if "validate step" in line:
            continue
        m = STEP.search(line)
        if m:
            step = int(m.group(1))
            rows[step] = (
                float(m.group(2)),
                float(m.group(3).replace(",", "")),
                float(m.group(4).replace(",", "")) if m.group(4) else None,
                float(m.group(5)) if m.group(5) else None,
            )
    if not rows:
        print(f"{label}: FAILED, no step lines in {path}")
        return 1
    peak = max(r[0] for r in rows.values())
    window = [s for s in sorted(rows) if first <= s <= last]
    if not window:
        print(f"{label}: FAILED/short, last logged step {max(rows)} < {first}; "
              f"peak memory = {peak:.2f} GiB (log {path})")
        return 1
    tps = statistics.median(rows[s][1] for s in window)
    tfl = [rows[s][2] for s in window if rows[s][2] is not None]
    mfu = [rows[s][3] for s in window if rows[s][3] is not None]
    extra = f"{len(window)} steps"
    if tfl:
        extra += f", median tflops {statistics.median(tfl):.1f}"
    if mfu:
        extra += f", median mfu {statistics.median(mfu):.2f}%"
    if window[-1] < last:
        extra += f", last logged step {max(rows)}"
    print(f"{label}: median tps over steps {window[0]}-{window[-1]} = {tps:,.0f}, "
          f"peak memory = {peak:.2f} GiB ({extra}; memory is torchtitan's max_reserved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
