"""CUDA graphs: the model's training forward and its backward, each replayed as one CUDA graph.

A compiled 1B step still launches a few thousand kernels, and the host has to keep ahead of the GPU on every
one of them. Replayed from a graph, the forward and the backward each cost one launch, which leaves the host
free for what stays eager (the optimizer, clipping, logging) while the GPU runs.

What is graphed is the model's ``forward`` (the plan's model), not Lightning's training step: the user's
``training_step``, its ``self.log`` calls and the loss reduction stay Python and run every step. Training
forwards run eagerly until one input signature (shapes, dtypes) has been seen ``warmup_steps`` times, so
torch.compile, cuBLAS and the allocator are warm; the next forward of that signature captures the forward and
its backward into one private memory pool, and later ones replay them. Anything else runs eagerly: evaluation,
forwards without gradients, keyword arguments, another signature (a short last batch). Gradients come back
through each parameter's ``.grad``: the backward graph writes them into tensors it owns, which are handed to
the parameters (or added to what an accumulation window already holds).

Replaying assumes what capturing saw stays where it was: the parameters' storage (optimizers update in place)
and one forward per backward. A parameter that moved, or a second graphed forward before the first one's
backward, raises instead of training on stale memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = ["GraphedForward", "apply_cuda_graphs"]

WARMUP_STEPS = 2
"""Eager training forwards of a signature before it is captured: the first compiles, the second runs
compiled, so nothing is compiled or autotuned while capturing."""

Signature = tuple[Any, ...]


def _shapes(args: tuple[Any, ...]) -> str:
    return ", ".join(str(tuple(a.shape)) if isinstance(a, Tensor) else repr(a) for a in args)


def _signature(args: tuple[Any, ...]) -> Signature:
    """What a replay needs to match: each argument's shape, dtype and device, or its value if not a tensor."""
    return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else ("value", a) for a in args)


@dataclass
class _Captured:
    """One captured forward and backward, and the static tensors they read and write."""

    signature: Signature
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    inputs: tuple[Any, ...]
    outputs: list[Tensor]
    output_spec: pytree.TreeSpec
    grad_outputs: list[Tensor]  # one per output that requires grad, in order
    params: list[nn.Parameter]
    param_addresses: list[int]
    grads: Sequence[Tensor | None]  # what the backward graph writes, per parameter (None: unused)
    # An input that requires grad, so the replay's outputs do and Lightning's backward reaches _Replay.backward.
    anchor: Tensor
    generation: int = 0  # forwards replayed; a backward belongs to the newest one only


class GraphedForward:
    """Stands in for ``model.forward``: eager until warm, then one graph replay per training forward."""

    def __init__(self, model: nn.Module, warmup_steps: int = WARMUP_STEPS) -> None:
        self.model = model
        self.eager_forward: Callable[..., Any] = model.forward
        self.warmup_steps = warmup_steps
        self.seen: dict[Signature, int] = {}
        self.captured: _Captured | None = None
        self.pool = torch.cuda.graph_pool_handle()
        # Warm-up and capture share one side stream: autograd ties each parameter's gradient accumulator to the
        # stream of the forward that first used it, and a capture may not make the default stream wait on it.
        self.stream = torch.cuda.Stream()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not (self.model.training and torch.is_grad_enabled()):
            return self.eager_forward(*args, **kwargs)
        with _uncached_autocast():
            return self._training_forward(args)

    def _training_forward(self, args: tuple[Any, ...]) -> Any:
        signature = _signature(args)
        if self.captured is None:
            self.seen[signature] = self.seen.get(signature, 0) + 1
            if self.seen[signature] <= self.warmup_steps:
                return self._eager_on_side_stream(args)
            self.captured = _capture(self.eager_forward, self.model, args, signature, self.pool, self.stream)
            rank_zero_info(f"cuda_graphs=True: captured {type(self.model).__name__}'s training forward and backward "
                           f"for inputs {_shapes(args)}; every later training step of those shapes replays them.")
        elif signature != self.captured.signature:
            return self.eager_forward(*args)
        captured = self.captured
        _check_parameters_stayed(captured)
        flat = _Replay.apply(captured, captured.anchor, *args)
        return pytree.tree_unflatten(list(flat), captured.output_spec)

    def _eager_on_side_stream(self, args: tuple[Any, ...]) -> Any:
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            outputs = self.eager_forward(*args)
        caller.wait_stream(self.stream)
        for output in pytree.tree_leaves(outputs):
            if isinstance(output, Tensor):
                output.record_stream(caller)  # the caller's stream reads it after the side stream is done
        return outputs


def _uncached_autocast() -> contextlib.AbstractContextManager[Any]:
    """The autocast every training forward of the graphed model runs under: the caller's, without its cast cache.

    The cache would hold casts the capture allocated past the end of the step, and replays skip the Python that
    fills it; captured without it, each replay casts anew, as an eager step does. Warm-ups and eager forwards of
    other shapes run the same way because compiled code is guarded on the cache setting: a warm-up with the cache
    would leave the capture to recompile, and nothing may compile inside a capture."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def apply_cuda_graphs(model: nn.Module, warmup_steps: int = WARMUP_STEPS) -> GraphedForward:
    """Replay ``model``'s training forward and backward as CUDA graphs from its ``warmup_steps + 1``-th
    training forward of one input signature on (see the module docstring)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            # Eager CUDA's embedding backward reads a count back to the host (it sorts the tokens first), which
            # no graph can capture; compiled, it is one scatter-add.
            module.compile()
    graphed = GraphedForward(model, warmup_steps)
    model.forward = graphed  # an instance attribute: nn.Module.__call__ finds it before the class's forward
    return graphed


def _capture(forward: Callable[..., Any], model: nn.Module, args: tuple[Any, ...], signature: Signature,
             pool: Any, stream: torch.cuda.Stream) -> _Captured:
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
    forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(forward_graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outputs = forward(*inputs)
        flat, spec = pytree.tree_flatten(outputs)
        if not all(isinstance(o, Tensor) for o in flat):
            raise ValueError(f"cuda_graphs=True replays outputs the graph wrote, so {type(model).__name__}.forward "
                             "must return tensors only (in any nesting); set cuda_graphs=False.")
        differentiable = [o for o in flat if o.requires_grad]
        if not differentiable:
            raise ValueError("cuda_graphs=True graphs the model's training forward and backward, but no output of "
                             f"{type(model).__name__}.forward requires grad; set cuda_graphs=False.")
        grad_outputs = [torch.empty_like(o) for o in differentiable]
        # autograd.grad, not backward: the parameters' AccumulateGrad nodes may still belong to an eager step's
        # graph (a loss kept alive), whose stream is not the one being captured.
        with torch.cuda.graph(backward_graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(differentiable, params, grad_outputs, allow_unused=True)
    except RuntimeError as error:
        raise RuntimeError(
            f"cuda_graphs=True could not capture {type(model).__name__}'s training forward and backward: {error}. "
            "Capturing needs a forward that never waits on the GPU (no .item(), .cpu(), .tolist() or shapes "
            "that depend on values), works on one CUDA stream and compiles nothing the warm-up forwards did not; "
            "set cuda_graphs=False.") from error
    return _Captured(signature, forward_graph, backward_graph, inputs, flat, spec, grad_outputs, params,
                     [p.data_ptr() for p in params], grads, torch.ones((), device=flat[0].device, requires_grad=True))


def _check_parameters_stayed(captured: _Captured) -> None:
    for param, address in zip(captured.params, captured.param_addresses):
        if param.data_ptr() != address:
            raise RuntimeError(
                "cuda_graphs=True replays graphs that read each parameter where it was at capture, but a "
                f"parameter of shape {tuple(param.shape)} now lives elsewhere (something assigned param.data or "
                "replaced the parameter after training started); update parameters in place, or set "
                "cuda_graphs=False.")


class _Replay(torch.autograd.Function):
    """One replay of the captured forward; its backward replays the captured backward."""

    @staticmethod
    def forward(ctx: Any, captured: _Captured, anchor: Tensor, *args: Any) -> tuple[Tensor, ...]:
        for static, arg in zip(captured.inputs, args):
            if isinstance(static, Tensor) and static.data_ptr() != arg.data_ptr():
                static.copy_(arg)
        for param, grad in zip(captured.params, captured.grads):
            if param.grad is not None and grad is not None and param.grad.data_ptr() == grad.data_ptr():
                # The forward graph's scratch memory is where the backward graph later put its gradients (one pool):
                # gradients an accumulation window still holds move out before the forward overwrites them.
                param.grad = param.grad.clone()
        captured.forward.replay()
        captured.generation += 1
        ctx.captured, ctx.generation = captured, captured.generation
        # Views of the graph's own outputs: the next replay overwrites them, as it does for any step's loss.
        outputs = tuple(o.detach() for o in captured.outputs)
        ctx.mark_non_differentiable(*(out for out, o in zip(outputs, captured.outputs) if not o.requires_grad))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        captured: _Captured = ctx.captured
        if ctx.generation != captured.generation:
            raise RuntimeError(
                "cuda_graphs=True keeps one forward's activations: the model ran another graphed training forward "
                "before this one's backward. Call the model once per training step (with the same shapes), or set "
                "cuda_graphs=False.")
        differentiable = [g for o, g in zip(captured.outputs, grads) if o.requires_grad]
        for static, grad in zip(captured.grad_outputs, differentiable):
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        _replay_backward(captured)
        return (None,) * len(ctx.needs_input_grad)


def _replay_backward(captured: _Captured) -> None:
    """Replay the backward and hand its gradients to the parameters, added to any the window already holds."""
    captured.backward.replay()
    for param, grad in zip(captured.params, captured.grads):
        if grad is not None:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
