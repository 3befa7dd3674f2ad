"""Our Triton kernels against inductor's kernels for the same torch code, at the 1B step's shapes (one GPU).

    python benchmarks/layer_kernels.py

Llama-3.2-1B shape: batch 2, seq 8192, bf16. RoPE (``titan_strategy.kernels.rope.rotate_pairs`` against
``llama_module.model.apply_rope_in_torch`` compiled) on the query (32 heads) and key (8 heads) of head_dim 64, each
gathering its table rows by position as the model does; RMSNorm (``titan_strategy.kernels.rms_norm.rms_norm``
against ``rms_norm_in_torch`` compiled) on the 2048-wide hidden state with a bf16 weight. For each it times forward,
and forward + backward, and prints how many output values differ between the two: for RoPE one bf16 ulp where a
fused multiply-add rounds once; for RMSNorm about a quarter of them, since inductor scales the normalized rows in
fp32 where eager torch and the kernel round them to bf16 first (benchmarks/RESULTS.md: 'RMSNorm kernel').
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from llama_module.model import apply_rope_in_torch, rms_norm_in_torch
from titan_strategy.kernels.rms_norm import rms_norm, rms_norm_kernel_takes
from titan_strategy.kernels.rope import rope_kernel_takes, rotate_pairs

BATCH, SEQ, HEAD_DIM, DIM, EPS = 2, 8192, 64, 2048, 1e-5


def _time_us(fn: Callable[[], object], iters: int = 30) -> float:
    """GPU time of one ``fn()``, replayed from a CUDA graph: launched one by one, these kernels (and autograd's
    bookkeeping in backward) take the host longer than the GPU, and event timing would measure the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def _compare(name: str, x: Tensor, kernels: dict[str, Callable[[Tensor], Tensor]]) -> None:
    """One table row per kernel: forward time and bandwidth (x read once, the output written once), forward +
    backward time; then how far the two outputs are apart."""
    grad = torch.randn_like(x)
    outputs = {}
    for kernel, fn in kernels.items():
        # Without autograd: an output holding its graph would keep x's gradient accumulator, made on this stream,
        # alive into the capture below, and capture refuses a backward that waits on the legacy stream.
        with torch.no_grad():
            outputs[kernel] = fn(x)

        def forward_backward(fn=fn) -> None:
            x.grad = None
            fn(x).backward(grad)

        forward = _time_us(lambda fn=fn: fn(x))
        both = _time_us(forward_backward)
        moved = 2 * x.numel() * x.element_size()
        print(f"| {name} | {kernel} | {forward:.1f} | {moved / forward / 1e3:.0f} | {both:.1f} |", flush=True)
    ours, inductor = outputs["Triton kernel"], outputs["inductor"]
    print(f"{name}: {(ours != inductor).sum().item()} of {x.numel()} values differ, by at most "
          f"{(ours - inductor).abs().max().item():.3g}")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| tensor | kernel | forward us | GB/s | forward + backward us |")
    print("|---|---|---|---|---|")
    table = torch.randn(SEQ, HEAD_DIM // 2, 2, device="cuda")
    positions = torch.arange(SEQ, device="cuda")
    rope = {"inductor": torch.compile(lambda x: apply_rope_in_torch(x, table[positions])),
            "Triton kernel": lambda x: rotate_pairs(x, table[positions])}
    for name, heads in (("RoPE q", 32), ("RoPE k", 8)):
        x = torch.randn(BATCH, SEQ, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        assert rope_kernel_takes(x, table)
        _compare(name, x, rope)
    weight = torch.empty(DIM, device="cuda", dtype=torch.bfloat16).uniform_(0.5, 1.5).requires_grad_()
    x = torch.randn(BATCH, SEQ, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert rms_norm_kernel_takes(x, weight)
    _compare("RMSNorm", x, {"inductor": torch.compile(lambda x: rms_norm_in_torch(x, weight, EPS)),
                            "Triton kernel": lambda x: rms_norm(x, weight, EPS)})


if __name__ == "__main__":
    main()
