"""The chunked cross-entropy's elementwise work on one GPU: inductor's kernels against the one-pass Triton kernel.

    python benchmarks/loss_chunk.py            # 1B shape: 1024-token chunks of a 128,256-entry vocabulary

Per chunk, after the logits' matrix product, the loss needs each token's log-sum-exp and the gradient
softmax - one-hot. The compiled torch function (``_loss_and_grad``) runs them as separate inductor kernels, each
streaming the chunk's 0.26 GB of bf16 logits from memory; the Triton kernel (``_row_kernel``) reads a token's row
twice in one program, the second time mostly from L2, and writes the gradient over it. Checked against float64 on
fresh random logits, then timed (median of CUDA-event timings, rotating over buffers larger than L2), then the
whole ``linear_cross_entropy`` forward and backward at the 1B step's 16,384 tokens, both ways.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
from collections.abc import Callable

import torch
import triton.testing

# The package exports the function under the module's name.
lce = importlib.import_module("titan_strategy.kernels.linear_cross_entropy")


def reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wide = logits.double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(wide, labels, ignore_index=lce.IGNORE_INDEX, reduction="sum")
    loss.backward()
    return loss.detach(), wide.grad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fresh_chunk(tokens: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (torch.randn(tokens, vocab, device=device) * 3).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[torch.rand(tokens, device=device) < 0.1] = lce.IGNORE_INDEX
    return logits, labels


def inductor(logits: torch.Tensor, labels: torch.Tensor, wants_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch code of a chunk, compiled: what ran on CUDA before the row kernel."""
    return lce._compiled(lce._loss_and_grad, logits)(logits, labels, wants_grad)


def triton_rows(block: int, warps: int) -> Callable:
    """The shipped path with the row kernel's block and warps set to these."""
    def run(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lce._ROW_BLOCK, lce._ROW_WARPS = block, warps
        return lce._loss_and_grad_of_chunk(logits, labels, True)
    return run


def time_rotating(run: Callable, buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Median ms of ``run`` on the next buffer each call (it overwrites the logits with gradients: as good to time)."""
    turn = itertools.cycle(buffers)
    return triton.testing.do_bench(lambda: run(*next(turn)), warmup=50, rep=300, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--step-tokens", type=int, default=16384)
    args = parser.parse_args()
    device = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    variants = {"inductor": inductor}
    for block, warps in ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 8), (8192, 16)):
        variants[f"triton {block}/{warps}"] = triton_rows(block, warps)

    shipped = lce._ROW_BLOCK, lce._ROW_WARPS
    rows = []
    buffers = [fresh_chunk(args.tokens, args.vocab, device) for _ in range(8)]  # 2.1 GB: no L2 reuse across calls
    chunk_bytes = args.tokens * args.vocab * 2
    for name, run in variants.items():
        logits, labels = fresh_chunk(args.tokens, args.vocab, device)
        want_loss, want_grad = reference(logits, labels)
        poison = logits.clone()
        loss, grad = run(poison, labels)
        loss_error, grad_error = abs(float(loss) - float(want_loss)) / abs(float(want_loss)), relative(grad, want_grad)
        finite = bool(torch.isfinite(grad).all())
        ms = time_rotating(run, buffers)
        rows.append((name, ms, chunk_bytes * 2 / ms / 1e6, loss_error, grad_error, finite))
    lce._ROW_BLOCK, lce._ROW_WARPS = shipped

    # The whole loss at the step's token count, forward and backward, each way.
    hidden = (torch.randn(args.step_tokens, args.dim, device=device) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(args.vocab, args.dim, device=device) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (args.step_tokens,), device=device)
    default = lce._loss_and_grad_of_chunk
    ways = {"inductor": inductor, "triton": default}
    whole: dict[str, list[float]] = {name: [] for name in ways}
    grads = {}
    for name in [*ways] * 3:  # alternated: clocks drift over a run of heavy matrix products
        lce._loss_and_grad_of_chunk = ways[name]

        def step() -> None:
            hidden.grad = weight.grad = None
            lce.linear_cross_entropy(hidden, weight, labels).backward()

        whole[name].append(triton.testing.do_bench(step, warmup=25, rep=500, return_mode="median"))
        step()
        grads[name] = (hidden.grad.clone(), weight.grad.clone())
    lce._loss_and_grad_of_chunk = default
    agreement = [relative(a, b) for a, b in zip(grads["triton"], grads["inductor"], strict=True)]

    print("\n| chunk kernel | ms | GB/s (one read + one write) | loss rel. error | grad rel. error | finite |")
    print("|---|---|---|---|---|---|")
    for name, ms, rate, loss_error, grad_error, finite in rows:
        print(f"| {name} | {ms:.3f} | {rate:.0f} | {loss_error:.1e} | {grad_error:.1e} | {finite} |")
    times = {name: " / ".join(f"{ms:.2f}" for ms in runs) for name, runs in whole.items()}
    print(f"\nlinear_cross_entropy, {args.step_tokens} tokens, forward + backward, ms (three alternated runs): "
          f"inductor {times['inductor']}, triton {times['triton']}; gradients (hidden, weight) agree to "
          f"{agreement[0]:.1e}, {agreement[1]:.1e}")


if __name__ == "__main__":
    main()
