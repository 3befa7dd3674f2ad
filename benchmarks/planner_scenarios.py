"""The TorchTitan paper's four scenarios through `titan plan`: its top 3, and where the paper's own layout ranks.

    python benchmarks/planner_scenarios.py

Scenario inputs the paper does not pin down are assumptions, printed with each scenario: H100 80 GB,
8 GPUs per node, seq 8192, and the global batch in tokens. The paper's per-GPU memory (where it reports
one) is printed next to the planner's estimate of the paper's layout.
"""

from __future__ import annotations

from dataclasses import replace

from llama_module.args import get_flavor
from llama_module.plan_cli import model_shape
from titan_strategy.planner.estimate import Job, Layout
from titan_strategy.planner.hardware import get_gpu
from titan_strategy.planner.search import check_layout, describe, plan_layouts, ranking_score

H100 = get_gpu("H100")
# (name, flavor, GPUs, seq_len, global batch tokens, the paper's layout, the paper's GiB per GPU or None)
SCENARIOS = [
    ("8B, 128 GPUs, FSDP", "8B", 128, 8192, 2 * 8192 * 128,
     Layout(1, 128, 1, 1, 1, None, 1, 1, "selective_op", False), None),
    ("70B, 256 GPUs, FSDP32 x TP8", "70B", 256, 8192, 16 * 8192 * 32,
     Layout(1, 32, 8, 1, 1, None, 1, 1, "full", False), 71.9),
    ("405B, 512 GPUs, FSDP8 x TP8 x PP8, 1F1B", "405B", 512, 8192, 2048 * 8192,
     Layout(1, 8, 8, 1, 8, "1F1B", 32, 1, "full", False), 82.5),
    ("405B, 512 GPUs, FSDP8 x TP8 x PP8, Interleaved1F1B", "405B", 512, 8192, 2048 * 8192,
     Layout(1, 8, 8, 1, 8, "Interleaved1F1B", 32, 2, "full", False), 72.7),
    ("8B, 8 GPUs, 262,144 tokens, CP8", "8B", 8, 262144, 262144,
     Layout(1, 1, 1, 8, 1, None, 1, 1, "full", False), None),
]


def main() -> None:
    for name, flavor, gpus, seq_len, tokens, paper, paper_gib in SCENARIOS:
        shape = model_shape(get_flavor(flavor))
        job = Job(gpus=gpus, gpus_per_node=8, gpu=H100, seq_len=seq_len, global_batch_tokens=tokens)
        plans = plan_layouts(shape, job, top=50)
        print(f"\n### {name} (assumed: H100 80 GB, seq {seq_len}, {tokens:,} tokens per step)")
        for index, plan in enumerate(plans[:3], start=1):
            print(f"  top {index}: {describe(plan.layout)}: {plan.estimate.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                  f"{plan.estimate.memory_gib:.1f} GiB")
        try:
            ours = check_layout(shape, paper, job)
        except ValueError as error:
            print(f"  paper layout: {error}")
            continue
        same_degrees = [i for i, plan in enumerate(plans, start=1) if replace(
            plan.layout, microbatches=paper.microbatches, ac=paper.ac, float8=paper.float8) == paper]
        rank = same_degrees[0] if same_degrees else f"> {len(plans)}"
        paper_memory = "" if paper_gib is None else f" (paper: {paper_gib} GiB, " \
            f"{100 * (ours.estimate.peak_allocated_gib / paper_gib - 1):+.0f}% on the peak)"
        print(f"  paper layout, rank {rank} (by degrees and schedule): {ours.estimate.tokens_per_s_per_gpu:,.0f} "
              f"tokens/s/GPU, peak {ours.estimate.peak_allocated_gib:.1f} GiB, need {ours.estimate.memory_gib:.1f} "
              f"GiB{paper_memory}; ranking score {ranking_score(ours):,.0f} against #1's {ranking_score(plans[0]):,.0f}")


if __name__ == "__main__":
    main()
