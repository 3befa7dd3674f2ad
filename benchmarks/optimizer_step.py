"""One AdamW step over a Llama's parameters, per AdamW kernel, on one GPU.

    python benchmarks/optimizer_step.py                         # the Llama-3.2-1B shape
    python benchmarks/optimizer_step.py --flavor 8B --n-layers 16

The parameters (fp32, the flavor's shapes) get random gradients, and each kernel takes ``--steps`` steps
after 3 of warm-up (where Triton compiles its kernel), with the LR changing every step as a schedule
changes it. Clipping is on, as in training: the fused and Triton kernels divide the gradients by the
clip scale as they read them; foreach clips first in a pass of its own, which is not timed. The table
gives the GPU's ms per ``optimizer.step()``, the bandwidth that implies (28 bytes per parameter: parameter,
gradient and both moments read, and parameter and moments written), the host's ms to launch the step
(in training it is hidden while the host runs ahead of the GPU) and each kernel's largest parameter
difference from torch's fused kernel after the same steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from llama_module.args import get_flavor
from llama_module.model import Llama
from titan_strategy.grad_norm import clip_grad_norm_, clip_scale, total_grad_norm
from titan_strategy.kernels.adamw import build_adamw

BYTES_PER_PARAMETER = 28
CLIP = 1.0


def _parameters(flavor: str, n_layers: int | None) -> list[torch.nn.Parameter]:
    config = get_flavor(flavor)
    if n_layers is not None:
        config = dataclasses.replace(config, n_layers=n_layers)
    with torch.device("meta"):
        shapes = [p.shape for p in Llama(config).parameters()]
    generator = torch.Generator("cuda").manual_seed(0)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=generator) * 0.02)
        param.grad = torch.randn(shape, device="cuda", generator=generator) * 1e-3
        params.append(param)
    return params


def _clip_and_schedule(kernel: str, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                       step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = 8e-4 * min(1.0, (step + 1) / 10)
    if kernel == "foreach":
        clip_grad_norm_(params, max_norm=CLIP)
    else:
        optimizer.grad_scale = clip_scale(total_grad_norm(params), CLIP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--n-layers", type=int)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    reference: list[torch.Tensor] | None = None
    print("| kernel | parameters | GPU ms per step | TB/s | host ms per step | max diff from fused |")
    print("|---|---|---|---|---|---|")
    for kernel in ("fused", "triton", "foreach"):
        params = _parameters(args.flavor, args.n_layers)
        numel = sum(p.numel() for p in params)
        optimizer = build_adamw(params, kernel, torch.device("cuda"), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)
        events, host_s = [], 0.0
        for step in range(3 + args.steps):
            _clip_and_schedule(kernel, optimizer, params, step)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()  # each step starts on an idle GPU: the host's launches are timed alone
            host_start = time.perf_counter()
            start.record()
            optimizer.step()
            end.record()
            if step >= 3:  # the first 3 warm up (and compile)
                events.append((start, end))
                host_s += time.perf_counter() - host_start
        torch.cuda.synchronize()
        ms = sum(start.elapsed_time(end) for start, end in events) / args.steps
        found = [p.detach().clone() for p in params]
        reference = reference or found
        diff = max((a - b).abs().max().item() for a, b in zip(found, reference))
        print(f"| {kernel} | {numel / 1e9:.2f} B | {ms:.2f} | {BYTES_PER_PARAMETER * numel / ms / 1e9:.2f} | "
              f"{1e3 * host_s / args.steps:.2f} | {diff:.1e} |", flush=True)
        del params, optimizer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
