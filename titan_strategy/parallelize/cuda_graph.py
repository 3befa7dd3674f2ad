"""CUDA graphs: the model's training forward and its backward, each replayed as one CUDA graph, on one device or
under FSDP2/HSDP.

A compiled 1B step still launches a few thousand kernels, and the host has to keep ahead of the GPU on every
one of them. Replayed from a graph, the forward and the backward each cost one launch, which leaves the host
free for what stays eager (the optimizer, clipping, logging) while the GPU runs.

What is graphed is the call of the model (the plan's model) with its hooks, not Lightning's training step: the
user's ``training_step``, its ``self.log`` calls and the loss reduction stay Python and run every step. Training
calls run eagerly until one input signature (shapes, dtypes) has been seen ``warmup_steps`` times, so
torch.compile, cuBLAS, NCCL and the allocator are warm; the next call of that signature captures the forward and
its backward into one private memory pool, and later ones replay them. Anything else runs eagerly: evaluation,
forwards without gradients, keyword arguments, another signature (a short last batch, unless the plan declares
``short_batch_padding``: then it replays, padded to the captured batch, its outputs cut back). Gradients come
back through each parameter's ``.grad``: the backward graph writes them into tensors it owns, which are handed to
the parameters (or added to what an accumulation window already holds).

Under FSDP2 the root's hooks are part of the call, so each graph holds the all-gathers, the resharding and the
gradient reduce-scatters (and HSDP's all-reduces) with the compute; FSDP's own streams are forked from the
capturing stream and joined back, as CUDA requires of work captured on other streams. The parameters a graph
reads are the shards the optimizer updates in place, and the gradients it writes are the sharded ones. Every
backward reduce-scatters: a replay skips the Python that would hold gradients back within an accumulation
window, so the strategy never asks it to.

Under more than one rank every graph holds collectives, so all ranks must capture, replay or run eagerly together:
each training call, the ranks agree on the input signature over the host group (one small gloo all-reduce, no
wait on the GPU), and a call whose shapes differ between ranks runs eagerly everywhere instead of hanging in a
replay that its peers never join (where neither the NCCL watchdog nor the Flight Recorder would see it); a capture
that raises on one rank, or gradient sync turned off on one, stops every rank.

Replaying assumes what capturing saw stays where it was: the parameters' storage (optimizers update in place)
and one forward per backward. A parameter that moved, or a second graphed forward before the first one's
backward, raises instead of training on stale memory; so does FSDP2 gradient sync turned off by the caller, which
replays would ignore.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["GraphedCall", "apply_cuda_graphs", "graphed_call"]

WARMUP_STEPS = 2
"""Eager training calls of a signature before it is captured: the first compiles, the second runs compiled, so
nothing is compiled or autotuned while capturing."""

Signature = tuple[Any, ...]


def _shapes(signature: Signature, dtypes: bool = False) -> str:
    """A signature as text: each tensor's shape (with ``dtypes``, its dtype and device type too, never the device
    index, which differs between ranks), or the value."""
    return ", ".join(repr(entry[1]) if entry[0] == "value" else f"{entry[0]} {entry[1]} {entry[2].type}" if dtypes
                     else str(entry[0]) for entry in signature)


def _signature(args: tuple[Any, ...]) -> Signature:
    """What a replay needs to match: each argument's shape, dtype and device, or its value if not a tensor."""
    return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else ("value", a) for a in args)


def _digest(signature: Signature) -> int:
    """A signature as a number every rank computes alike (a 62-bit hash of its text)."""
    text = _shapes(signature, dtypes=True)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest()) >> 2


def _fewer_samples(signature: Signature, captured: Signature) -> bool:
    """Whether ``signature`` is ``captured``'s with fewer samples: every tensor as many samples fewer along its first
    dimension, everything else alike."""
    if len(signature) != len(captured):
        return False
    samples = set()
    for entry, static in zip(signature, captured):
        if entry[0] == "value" or static[0] == "value":
            if entry != static:
                return False
        elif entry[1:] != static[1:] or not entry[0] or entry[0][1:] != static[0][1:]:
            return False
        else:
            samples.add((entry[0][0], static[0][0]))
    if len(samples) != 1:
        return False
    ((fewer, captured_samples),) = samples
    return 0 < fewer < captured_samples


Decision = Literal["eager", "capture", "replay", "pad"]


class CaptureSchedule:
    """Which way each training call goes: eagerly while its signature warms up, then the capture, then replays of
    that signature, and with ``padding`` (the plan's ``short_batch_padding``) of fewer samples, padded; any other
    runs eagerly. With a host ``group`` (more than one rank), every call's signature is first agreed on: one that
    differs between ranks runs eagerly on all of them and counts towards nothing, so the ranks take the same
    decisions in the same order."""

    def __init__(self, warmup_steps: int, group: dist.ProcessGroup | None = None,
                 padding: tuple[int | None, ...] | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.group = group
        self.padding = padding
        self.seen: dict[Signature, int] = {}
        self.captured: Signature | None = None
        self.disagreements = 0  # calls the ranks ran eagerly because their shapes differed
        self.uncaptured_calls = 0  # calls of other shapes after the capture, run eagerly
        self.padded_calls = 0  # calls of fewer samples after the capture, replayed padded

    def decide(self, signature: Signature, refusal: str | None = None) -> Decision:
        """The way this call goes. ``refusal`` says why this rank cannot train on: it is raised only after the
        agreement, and every other rank raises with it, so none is left waiting in a collective this one leaves."""
        digest = 0 if self.group is None else _digest(signature)  # one rank: nothing to hash
        same, refused_somewhere = self._agree(digest, refusal is not None)
        if refusal is not None:
            raise RuntimeError(refusal)
        if refused_somewhere:
            raise RuntimeError("cuda_graphs=True: another rank cannot train on (its error says why), so this rank "
                               "stops too rather than wait in collectives that rank never joins.")
        if not same:
            self.disagreements += 1
            if self.disagreements == 1:
                rank_zero_warn(f"cuda_graphs=True: the ranks called the model with different input shapes (rank 0: "
                               f"{_shapes(signature)}), so every rank ran that call eagerly, as it will each such "
                               "call. Give every rank batches of one shape (a fixed-length collator, drop_last=True) "
                               "to replay.")
            return "eager"
        if self.captured is None:
            self.seen[signature] = self.seen.get(signature, 0) + 1
            return "eager" if self.seen[signature] <= self.warmup_steps else "capture"
        if signature == self.captured:
            return "replay"
        if self.padding is not None and _fewer_samples(signature, self.captured):
            self.padded_calls += 1
            if self.padded_calls == 1:
                rank_zero_info(f"cuda_graphs=True: a training call of shapes {_shapes(signature)} replays the graphs "
                               f"of {_shapes(self.captured)}, padded as the plan's short_batch_padding says; its "
                               "outputs are cut back to its own samples.")
            return "pad"
        self.uncaptured_calls += 1
        if self.uncaptured_calls == 1:
            padding = "" if self.padding is not None else (
                ", or, if the model's samples never meet, declare ParallelPlan(short_batch_padding=...) to replay "
                "short batches padded")
            rank_zero_warn(f"cuda_graphs=True: a training call of shapes {_shapes(signature)} (the graphs are of "
                           f"{_shapes(self.captured)}) ran eagerly, as each call of other shapes will: it compiles "
                           "anew for those shapes and needs activation memory of its own beside the graphs' pool (at "
                           "the 1B shape, a short last batch reserved 11 GiB more). Give every batch one shape "
                           f"(drop_last=True, a fixed-length collator) to replay them all{padding}.")
        return "eager"

    def settle_capture(self, signature: Signature, captured_here: bool) -> bool:
        """Whether every rank captured ``signature``: a rank whose capture raised must not leave the others to
        replay collectives it never joins. Only then do later calls of it replay; otherwise the next one captures
        anew (on every rank), so a caught failure never leaves a schedule pointing at graphs that do not exist."""
        _, failed_somewhere = self._agree(0, not captured_here)
        if not failed_somewhere:
            self.captured = signature
        return not failed_somewhere

    def _agree(self, value: int, flag: bool) -> tuple[bool, bool]:
        """Whether every rank holds the same ``value``, and whether any rank raised ``flag``: one all-reduce (MAX)
        of ``[value, -value, flag]``, whose first two entries meet only where the values do."""
        if self.group is None:
            return True, flag
        extremes = torch.tensor([value, -value, int(flag)], dtype=torch.int64)
        # ProcessGroup's own all-reduce (not dist.all_reduce): the tests run two ranks as threads of one process,
        # on groups torch's registry does not know.
        self.group.allreduce([extremes], op=dist.ReduceOp.MAX).wait()
        return int(extremes[0]) == -int(extremes[1]), bool(extremes[2])


def _address(tensor: Tensor) -> int:
    """Where a tensor's data lives: a DTensor's (an FSDP shard or its gradient) is where its local shard lives, and
    a wrapper subclass's (torchao's float8 weight) where the first tensor it wraps lives; theirs read 0."""
    while True:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        elif is_traceable_wrapper_subclass(tensor):
            tensor = getattr(tensor, tensor.__tensor_flatten__()[0][0])
        else:
            return tensor.data_ptr()


@dataclass
class _Captured:
    """One captured forward and backward, and the static tensors they read and write."""

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
    fsdp_streams: list[torch.cuda.Stream]
    generation: int = 0  # forwards replayed; a backward belongs to the newest one only


class GraphedCall:
    """Stands in for calling the model (its hooks and ``forward``): eager until warm, then one graph replay per
    training call."""

    def __init__(self, model: nn.Module, eager_call: Callable[..., Any], schedule: CaptureSchedule) -> None:
        self.model = model
        self.name = type(model).__name__  # for messages: the model's own class, not the one graphing it
        self.eager_call = eager_call
        self.schedule = schedule
        self.captured: _Captured | None = None
        self.replays = 0  # training calls that replayed the graphs (release() keeps the count)
        # Resharded before the capture and before the first replay after eager work (see _reshard).
        self.fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
        self.ran_eagerly = True
        self.pool = torch.cuda.graph_pool_handle()
        # Every training call runs on this side stream, the capture included: autograd ties each parameter's
        # gradient accumulator to the stream of the forward that made it, and a capture may not make another
        # stream wait on it.
        self.stream = torch.cuda.Stream()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not (self.model.training and torch.is_grad_enabled()):
            self.ran_eagerly = True
            return self.eager_call(*args, **kwargs)
        with _uncached_autocast():
            return self._training_call(args)

    def _training_call(self, args: tuple[Any, ...]) -> Any:
        signature = _signature(args)
        decision = self.schedule.decide(signature, _gradient_sync_refusal(self.model, self.fsdp_modules))
        if decision == "eager":
            return self._eager_on_side_stream(args)
        if decision == "capture":
            self._reshard()
            try:
                captured = self._capture(args)
            except BaseException:
                self.schedule.settle_capture(signature, False)
                raise
            if not self.schedule.settle_capture(signature, True):
                raise RuntimeError(f"cuda_graphs=True: another rank could not capture {self.name}'s training forward "
                                   "and backward (its error says why), so this rank stops too rather than replay "
                                   "collectives that rank never joins.")
            self.captured = captured
            rank_zero_info(f"cuda_graphs=True: captured {self.name}'s training forward and backward "
                           f"for inputs {_shapes(signature)}; every later training step of those shapes replays them.")
        captured = self.captured
        assert captured is not None, "released graphs are not replayed (teardown releases them)"
        _check_parameters_stayed(captured)
        if self.ran_eagerly:
            self._reshard()
        self.replays += 1
        flat = list(_Replay.apply(captured, self.schedule.padding or (), captured.anchor, *args))
        if decision == "pad":  # the rows of padded samples are cut off; what has no row per sample is left whole
            batch, samples = _samples(captured.inputs), _samples(args)
            flat = [o[:samples] if o.dim() and o.shape[0] == batch else o for o in flat]
        return pytree.tree_unflatten(flat, captured.output_spec)

    def _capture(self, args: tuple[Any, ...]) -> _Captured:
        params = [p for p in self.model.parameters() if p.requires_grad]
        inputs = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
        forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        forked = _fsdp_streams(self.model)
        # The backward below hands its gradients to each parameter's .grad (FSDP2 sets the sharded ones in its hooks);
        # what an accumulation window holds there steps aside, so the graph writes tensors of its own.
        held = [p.grad for p in params]
        for param in params:
            param.grad = None
        torch.cuda.synchronize()
        try:
            with _capturing(forward_graph, self.pool, self.stream, forked):
                outputs = self.eager_call(*inputs)
            flat, spec = pytree.tree_flatten(outputs)
            if not all(isinstance(o, Tensor) for o in flat):
                raise ValueError(f"cuda_graphs=True replays outputs the graph wrote, so {self.name}.forward "
                                 "must return tensors only (in any nesting); set cuda_graphs=False.")
            differentiable = [o for o in flat if o.requires_grad]
            if not differentiable:
                raise ValueError("cuda_graphs=True graphs the model's training forward and backward, but no output of "
                                 f"{self.name}.forward requires grad; set cuda_graphs=False.")
            grad_outputs = [torch.empty_like(o) for o in differentiable]
            with _capturing(backward_graph, self.pool, self.stream, forked):
                torch.autograd.backward(differentiable, grad_outputs)
        except RuntimeError as error:
            raise RuntimeError(
                f"cuda_graphs=True could not capture {self.name}'s training forward and backward: {error}. "
                "Capturing needs a forward that never waits on the GPU (no .item(), .cpu(), .tolist() or shapes "
                "that depend on values), runs on the current stream (or FSDP2's) and compiles nothing the warm-up "
                "calls did not; set cuda_graphs=False.") from error
        finally:
            grads = [p.grad for p in params]
            for param, grad in zip(params, held):
                param.grad = grad
        anchor = torch.ones((), device=flat[0].device, requires_grad=True)
        return _Captured(forward_graph, backward_graph, inputs, flat, spec, grad_outputs, params,
                         [_address(p) for p in params], grads, anchor, forked)

    def release(self) -> None:
        """Drop the graphs and their memory pool. Each captured NCCL collective holds its communicator until its
        graph is destroyed, so this runs before the process group is torn down (TitanStrategy.teardown)."""
        self.captured = self.schedule.captured = None  # a later training call would warm up and capture anew
        torch.cuda.synchronize()
        gc.collect()  # autograd nodes of the last replay may still hold the graphs

    def _reshard(self) -> None:
        """Free the parameters an eager FSDP2 forward left gathered: a graph gathers into memory of its own, and an
        eager forward after replays would otherwise compute with values gathered before them."""
        for module in self.fsdp_modules:
            module.reshard()
        self.ran_eagerly = False

    def _eager_on_side_stream(self, args: tuple[Any, ...]) -> Any:
        self.ran_eagerly = True
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            outputs = self.eager_call(*args)
        caller.wait_stream(self.stream)
        for output in pytree.tree_leaves(outputs):
            if isinstance(output, Tensor):
                output.record_stream(caller)  # the caller's stream reads it after the side stream is done
        return outputs


def _uncached_autocast() -> contextlib.AbstractContextManager[Any]:
    """The autocast every training call of the graphed model runs under: the caller's, without its cast cache.

    The cache would hold casts the capture allocated past the end of the step, and replays skip the Python that
    fills it; captured without it, each replay casts anew, as an eager step does. Warm-ups and eager calls of
    other shapes run the same way because compiled code is guarded on the cache setting: a warm-up with the cache
    would leave the capture to recompile, and nothing may compile inside a capture."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def apply_cuda_graphs(model: nn.Module, host_group: dist.ProcessGroup | None = None,
                      warmup_steps: int = WARMUP_STEPS,
                      short_batch_padding: tuple[int | None, ...] | None = None) -> GraphedCall:
    """Replay ``model``'s training forward and backward as CUDA graphs from its ``warmup_steps + 1``-th
    training call of one input signature on (see the module docstring). Under more than one rank, the ranks
    agree on each call's signature over ``host_group`` (gloo). ``short_batch_padding`` (``ParallelPlan``'s) lets
    calls of fewer samples replay too, padded."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            # Eager CUDA's embedding backward reads a count back to the host (it sorts the tokens first), which
            # no graph can capture; compiled, it is one scatter-add.
            module.compile()
    eager_class = type(model)
    several_ranks = host_group is not None and host_group.size() > 1
    schedule = CaptureSchedule(warmup_steps, host_group if several_ranks else None, short_batch_padding)
    graphed = GraphedCall(model, functools.partial(eager_class.__call__, model), schedule)
    # Calling a module runs its hooks around forward, and FSDP2's root does its work in hooks, so the call itself
    # is what is graphed: a subclass made for this model (as fully_shard makes one) routes __call__ to it.
    model.__class__ = type(f"CUDAGraphed{eager_class.__name__}", (eager_class,), {"__call__": _call_graphed})
    model._titan_graphed_call = graphed
    return graphed


def _call_graphed(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return model._titan_graphed_call(*args, **kwargs)


def graphed_call(model: object) -> GraphedCall | None:
    """The CUDA graphs ``apply_cuda_graphs`` put on ``model``, if it is a model they were put on."""
    return getattr(model, "_titan_graphed_call", None)


def _fsdp_streams(model: nn.Module) -> list[torch.cuda.Stream]:
    """The streams FSDP2 runs its copies and collectives on (none without FSDP): a capture forks them and joins
    them back, or their work would run once, eagerly, instead of being captured."""
    if not isinstance(model, FSDPModule):
        return []
    comm_context = model._get_fsdp_state()._comm_ctx
    return [stream for stream in vars(comm_context).values() if isinstance(stream, torch.cuda.Stream)]


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream,
               forked: list[torch.cuda.Stream]) -> Generator[None, None, None]:
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        for other in forked:
            other.wait_stream(stream)
        yield
        for other in forked:
            stream.wait_stream(other)


def _gradient_sync_refusal(model: nn.Module, fsdp_modules: list[FSDPModule]) -> str | None:
    """Why FSDP2 gradient sync turned off by the caller is refused (None while it is on; the strategy never turns it
    off under graphs): a replayed backward reduces its gradients as its capture did whatever the setting, and an
    eager one (a warm-up, a short batch) would keep its unsharded gradients for a later eager backward that may never
    come, so a window ending in a replay would step without them."""
    for module in fsdp_modules:
        state = module._get_fsdp_state()
        # torch 2.13 keeps a list of parameter groups per module; torch 2.11 keeps one (or None).
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [] if state._fsdp_param_group is None else [state._fsdp_param_group]
        if any(not (group.reduce_grads and group.all_reduce_grads) for group in groups):
            name = next(name for name, candidate in model.named_modules() if candidate is module) or "the root"
            return (
                f"cuda_graphs=True: gradient sync is off on the model's FSDP2 module {name!r} "
                "(set_requires_gradient_sync(False) or set_requires_all_reduce(False)), but a replayed backward "
                "reduces its gradients every time, as its capture did, and an eager one would hold them back for a "
                "backward no replay makes. TitanStrategy accumulates gradients without it under graphs: remove the "
                "call, or set cuda_graphs=False.")
    return None


def _check_parameters_stayed(captured: _Captured) -> None:
    for param, address in zip(captured.params, captured.param_addresses):
        if _address(param) != address:
            raise RuntimeError(
                "cuda_graphs=True replays graphs that read each parameter where it was at capture, but a "
                f"parameter of shape {tuple(param.shape)} now lives elsewhere (something assigned param.data or "
                "replaced the parameter after training started); update parameters in place, or set "
                "cuda_graphs=False.")


class _Replay(torch.autograd.Function):
    """One replay of the captured forward; its backward replays the captured backward."""

    @staticmethod
    def forward(ctx: Any, captured: _Captured, padding: tuple[int | None, ...], anchor: Tensor,
                *args: Any) -> tuple[Tensor, ...]:
        for index, (static, arg) in enumerate(zip(captured.inputs, args)):
            if isinstance(static, Tensor) and static.data_ptr() != arg.data_ptr():
                _fill(static, arg, padding[index] if index < len(padding) else None)
        for param, grad in zip(captured.params, captured.grads):
            if param.grad is not None and grad is not None and _address(param.grad) == _address(grad):
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


def _samples(args: tuple[Any, ...]) -> int:
    """A call's batch size: its first tensor's first dimension."""
    return next(arg.shape[0] for arg in args if isinstance(arg, Tensor))


def _fill(static: Tensor, arg: Tensor, pad_value: int | None) -> None:
    """Copy ``arg`` into the graph's input ``static``; samples it lacks hold ``pad_value``, or copy its first sample."""
    samples = arg.shape[0]
    static[:samples].copy_(arg)
    padded = static[samples:]
    if pad_value is not None:
        padded.fill_(pad_value)
    elif padded.numel():
        padded.copy_(arg[:1].expand_as(padded))


def _replay_backward(captured: _Captured) -> None:
    """Replay the backward and hand its gradients to the parameters, added to any the window already holds."""
    captured.backward.replay()
    caller = torch.cuda.current_stream()
    for stream in captured.fsdp_streams:
        # An eager FSDP2 backward in the same step (another call of the model) may still be reducing into the
        # gradients added to below; FSDP waits for that only at the end of the whole backward.
        caller.wait_stream(stream)
    for param, grad in zip(captured.params, captured.grads):
        if grad is not None:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
