"""Causal SDPA forward + backward per CUDA backend, at the attention shapes of the throughput benchmark.

    python benchmarks/attention_backends.py

For each shape and backend (flash, memory-efficient, cuDNN) it times forward + backward of
``F.scaled_dot_product_attention(is_causal=True)`` in bf16, with the kv heads expanded by
``repeat_interleave`` (as ``llama_module`` does) and, where the backend takes it, with
``enable_gqa=True`` instead. It prints ms per call, the achieved TFLOP/s (causal FLOPs: forward
2 matmuls of b*h*s*s*d over half the score matrix, backward 2.5 times the forward) and the largest
difference of output and gradients from the flash backend's, and which backend torch picks by default.
Where the ``flash-attn-4`` package is installed, its ``flash_attn_func`` (FlashAttention-4, CuTe DSL;
Hopper and Blackwell) is timed too, on (batch, seq, heads, head_dim) inputs with the kv heads grouped.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_strategy.kernels.flash_attention4 import flash_attention4_installed

SHAPES = {"1B": (2, 32, 8, 8192, 64), "8B": (1, 32, 8, 8192, 128)}  # batch, q heads, kv heads, seq, head_dim
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def _run(backend: SDPBackend, q, k, v, grad, gqa: bool):
    for tensor in (q, k, v):
        tensor.grad = None
    repeats = q.shape[1] // k.shape[1]
    with sdpa_kernel([backend]):
        if gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1),
                                                 is_causal=True)
        out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| shape | backend | kv heads | ms fwd+bwd | TFLOP/s | max diff from flash (out, dq, dk, dv) |")
    print("|---|---|---|---|---|---|")
    for shape_name, (batch, heads, kv_heads, seq, head_dim) in SHAPES.items():
        generator = torch.Generator("cuda").manual_seed(0)
        make = lambda h, batch=batch, seq=seq, head_dim=head_dim, generator=generator: (  # noqa: E731
            torch.randn(batch, h, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
            .requires_grad_())
        q, k, v = make(heads), make(kv_heads), make(kv_heads)
        grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        flops = 4 * batch * heads * seq * seq * head_dim / 2 * 3.5
        expanded = (q, k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1))
        default = SDPBackend(torch._fused_sdp_choice(*expanded, is_causal=True))
        print(f"| {shape_name} | default pick: {default.name} | | | | |")
        reference = [t.clone() for t in _run(SDPBackend.FLASH_ATTENTION, q, k, v, grad, gqa=False)]
        for name, backend in BACKENDS.items():
            for gqa in (False, True):
                try:
                    found = _run(backend, q, k, v, grad, gqa)
                except RuntimeError as error:
                    print(f"| {shape_name} | {name} | {'native' if gqa else 'expanded'} | not supported: "
                          f"{str(error).splitlines()[0][:80]} | | |")
                    continue
                diffs = ", ".join(f"{(a.float() - b.float()).abs().max().item():.3g}" for a, b in zip(found, reference))
                ms = _time_ms(functools.partial(_run, backend, q, k, v, grad, gqa), args.iters)
                print(f"| {shape_name} | {name} | {'native' if gqa else 'expanded'} | {ms:.2f} | "
                      f"{flops / ms / 1e9:.0f} | {diffs} |", flush=True)
        if flash_attention4_installed():
            _time_fa4(shape_name, q, k, v, grad, reference, flops, args.iters)


def _time_fa4(shape_name: str, q, k, v, grad, reference, flops: float, iters: int) -> None:
    from flash_attn.cute import flash_attn_func

    q4, k4, v4 = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    grad4 = grad.transpose(1, 2).contiguous()

    def run():
        for tensor in (q4, k4, v4):
            tensor.grad = None
        out = flash_attn_func(q4, k4, v4, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad4)
        return out.detach(), q4.grad, k4.grad, v4.grad

    try:
        found = [t.transpose(1, 2) for t in run()]
    except Exception as error:  # noqa: BLE001 - a beta package: report any failure as a row
        print(f"| {shape_name} | FA4 | native | failed: {type(error).__name__}: "
              f"{str(error).splitlines()[0][:80]} | | |")
        return
    diffs = ", ".join(f"{(a.float() - b.float()).abs().max().item():.3g}" for a, b in zip(found, reference))
    ms = _time_ms(run, iters)
    print(f"| {shape_name} | FA4 | native | {ms:.2f} | {flops / ms / 1e9:.0f} | {diffs} |", flush=True)


if __name__ == "__main__":
    main()
