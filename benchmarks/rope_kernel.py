"""RoPE on one GPU: inductor's kernels for the torch code against the Triton kernel, at the 1B step's q and k.

    python benchmarks/rope_kernel.py

For the query (32 heads) and key (8 heads) of the Llama-3.2-1B shape (batch 2, seq 8192, head_dim 64, bf16), it
times forward, and forward + backward, of ``llama_module.model.apply_rope_in_torch`` compiled and of
``titan_strategy.kernels.rope.rotate_pairs``, each gathering its table rows by position as the model does, and
prints how many values differ between the two (one bf16 ulp where a fused multiply-add rounds once).
"""

from __future__ import annotations

import torch

from llama_module.model import apply_rope_in_torch
from titan_strategy.kernels.rope import rope_kernel_takes, rotate_pairs

BATCH, SEQ, HEAD_DIM = 2, 8192, 64


def _time_us(fn, iters: int = 30) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    table = torch.randn(SEQ, HEAD_DIM // 2, 2, device="cuda")
    positions = torch.arange(SEQ, device="cuda")
    kernels = {"inductor": torch.compile(lambda x: apply_rope_in_torch(x, table[positions])),
               "Triton kernel": lambda x: rotate_pairs(x, table[positions])}
    print("| tensor | kernel | forward us | GB/s | forward + backward us |")
    print("|---|---|---|---|---|")
    for name, heads in (("q", 32), ("k", 8)):
        x = torch.randn(BATCH, SEQ, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        assert rope_kernel_takes(x, table)
        outputs = {}
        for kernel, rotate in kernels.items():
            outputs[kernel] = rotate(x)

            def forward_backward(rotate=rotate, x=x, grad=grad) -> None:
                x.grad = None
                rotate(x).backward(grad)

            forward = _time_us(lambda rotate=rotate, x=x: rotate(x))
            both = _time_us(forward_backward)
            moved = 2 * x.numel() * x.element_size()  # read once, written once
            print(f"| {name} | {kernel} | {forward:.1f} | {moved / forward / 1e3:.0f} | {both:.1f} |", flush=True)
        differ = (outputs["inductor"] != outputs["Triton kernel"]).sum().item()
        print(f"{name}: {differ} of {x.numel()} values differ, by at most "
              f"{(outputs['inductor'] - outputs['Triton kernel']).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
