"""The TorchTitan paper's runs through `titan plan`: its top 3, where the paper's own layout ranks, and how
the planner's memory and speed estimates of that layout compare with the published numbers.

    python benchmarks/planner_scenarios.py

The runs and their setup (96 GB H100s at 500 W, eager loss, Float8 and AsyncTP where the paper used
them) are in ``llama_module/paper_runs.py``.
"""

from __future__ import annotations

from llama_module.paper_runs import PAPER_RUNS
from titan_strategy.planner.estimate import estimate
from titan_strategy.planner.search import Plan, describe, plan_layouts, ranking_score, row_key


def main() -> None:
    for run in PAPER_RUNS:
        job, paper = run.job, run.layout
        plans = plan_layouts(run.shape, job, top=100)
        print(f"\n### {run.name}: {job.gpus} x {job.gpu.name} {job.gpu.memory_gib:g} GB, seq {job.seq_len}, "
              f"{job.global_batch_tokens:,} tokens per step")
        for index, plan in enumerate(plans[:3], start=1):
            print(f"  top {index}: {describe(plan.layout)}: {plan.estimate.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                  f"{plan.estimate.memory_gib:.1f} GiB")
        # The paper's own layout with its recipe, against its measured numbers; ranked by degrees and schedule.
        ours = estimate(run.shape, paper, job)
        same_degrees = [i for i, plan in enumerate(plans, start=1) if row_key(plan.layout) == row_key(paper)]
        rank = same_degrees[0] if same_degrees else f"> {len(plans)}"
        print(f"  paper layout, rank {rank} (by degrees and schedule): {describe(paper)}")
        print(f"    speed {ours.tokens_per_s_per_gpu:,.0f} tokens/s/GPU (paper {run.tokens_per_s_per_gpu:,.0f}, "
              f"{100 * (ours.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu - 1):+.0f}%); reserved "
              f"{ours.peak_reserved_gib:.1f} GiB (paper {run.memory_gib} GiB, "
              f"{100 * (ours.peak_reserved_gib / run.memory_gib - 1):+.0f}%); ranking score "
              f"{ranking_score(Plan(paper, ours, ())):,.0f} against #1's {ranking_score(plans[0]):,.0f}")


if __name__ == "__main__":
    main()
