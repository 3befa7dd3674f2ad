"""Context parallelism: each rank holds a load-balanced share of every sequence; attention becomes ring attention.

The sequence is cut into ``2 * cp`` equal chunks and CP rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r``. Under a causal mask the early chunks are cheap and the late ones expensive, so
pairing them gives every rank the same work. ``apply_cp`` makes the attention modules a
``ContextParallelPlan`` names take their query, key and value as DTensors sharded on the sequence dim
over the ``cp`` mesh. Inside ``ring_attention()`` DTensor runs scaled dot-product attention on such
tensors as torch's ring attention: queries stay, key/value shards travel round the ring (all-gathered
or passed on by all-to-all, the rotate method), and partial results are merged by their logsumexp.
torch registers that for its CUDA kernels (flash, memory-efficient, cuDNN); the CPU kernel, which torch
leaves out, is registered here the same way. Attention under a mask (block-causal documents) is not split
into ring steps: the mask covers this rank's queries and all keys, so each rank gathers every key and value
(as torch's own FlexAttention CP does) and attends locally. The per-step work (cutting the batch and the
position-indexed buffers, gathering predictions) is ``SequenceSharder``'s.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import (
    _attention,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
)

from titan_strategy.config.context_parallel import RotateMethod
from titan_strategy.distributed import per_simulated_rank, simulating_ranks
from titan_strategy.plan import ContextParallelPlan

__all__ = ["SequenceSharder", "apply_cp", "check_cp_plan", "check_cp_sequence_length", "gather_sequence",
           "load_balanced_shard", "ring_attention"]

log = logging.getLogger(__name__)

# torch 2.13 renamed it (the old name warns there); torch 2.11 has only the old name.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_SEQ_DIM = 2  # of the (batch, heads, seq, head_dim) tensors attention sees
_aten = torch.ops.aten


def check_cp_plan(plan: ContextParallelPlan | None, cp: int) -> None:
    if plan is None:
        raise ValueError(f"context_parallel_size={cp}, but the module's parallel_plan() declares no context_parallel "
                         "plan; set context_parallel_size=1 or add one (see llama_module/plan.py).")


def check_cp_sequence_length(seq_len: int, cp: int, sequence_parallel_tp: int) -> None:
    """Each rank keeps 2 chunks of ``seq_len / (2 * cp)`` tokens; sequence parallelism splits those ``tp`` ways."""
    multiple = 2 * cp * sequence_parallel_tp
    if seq_len % multiple == 0:
        return
    split = f"2 x context_parallel_size={cp} chunks"
    if sequence_parallel_tp > 1:
        split += f", and sequence parallelism each rank's share across tensor_parallel_size={sequence_parallel_tp}"
    fix = ", or sequence_parallel=False" if sequence_parallel_tp > 1 else ""
    raise ValueError(f"Context parallelism splits each sequence into {split}, but the batch has seq_len={seq_len}; "
                     f"use a seq_len divisible by {multiple}{fix}.")


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, plan: ContextParallelPlan) -> None:
    """Make the plan's attention modules take sequence-sharded DTensors (the model may still be on meta)."""
    modules = [module for name, module in model.named_modules() if fnmatch.fnmatchcase(name, plan.attention)]
    if not modules:
        raise ValueError(f"The context_parallel plan's attention={plan.attention!r} matches no submodule of "
                         f"{type(model).__name__}; name the modules that call scaled_dot_product_attention.")
    for module in modules:
        module.register_forward_pre_hook(partial(_to_sequence_shards, cp_mesh), with_kwargs=True)
        module.register_forward_hook(_to_local)
    log.info("Applied context parallelism over %d ranks to %d attention modules", cp_mesh.size(), len(modules))


def _to_sequence_shards(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    mask = args[3] if len(args) == 4 else None
    if kwargs or len(args) not in (3, 4) or not all(isinstance(arg, Tensor) for arg in args[:3]):
        raise ValueError(
            f"Context parallelism runs {type(module).__name__} as attention of (query, key, value[, mask]), but it "
            f"was called with {len(args)} positional and {sorted(kwargs)} keyword arguments; call it that way, "
            "or set context_parallel_size=1."
        )
    query, key, value = args[:3]
    if mask is not None:
        # The mask covers this rank's queries and every key, in the sequence's order: gather keys and values
        # (their gradients are reduce-scattered back) and attend locally.
        key, value = (_in_order(_all_gather_autograd(t.contiguous(), _SEQ_DIM, mesh.get_group()),
                                mesh.size(), _SEQ_DIM) for t in (key, value))
        return (query, key, value, mask), {}
    if simulating_ranks():
        raise ValueError("Causal attention under context parallelism is torch's ring attention, which takes each "
                         "rank's place in the ring from dist.get_rank(): one number for every simulated rank. "
                         "Simulate CP with block-causal attention (its keys and values are all-gathered), or run "
                         "the causal ring on real processes.")
    # Grouped-query attention: torch's ring attention expects as many key/value heads as query heads,
    # so each kv head is repeated for the query heads it serves, as the kernels would do themselves.
    groups = query.size(1) // key.size(1)
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return tuple(DTensor.from_local(t, mesh, (Shard(_SEQ_DIM),), run_check=False) for t in (query, key, value)), {}


def _in_order(gathered: Tensor, cp: int, dim: int) -> Tensor:
    """Every rank's two chunks, concatenated rank by rank, back in sequence order (``SequenceSharder.shard``'s
    inverse): rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``."""
    pairs = gathered.chunk(cp, dim)
    heads = [pair.chunk(2, dim)[0] for pair in pairs]
    tails = [pair.chunk(2, dim)[1] for pair in reversed(pairs)]
    return torch.cat(heads + tails, dim=dim)


def _to_local(module: nn.Module, args: tuple, output: Any) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


# ---- ring attention for torch's CPU kernel -------------------------------------------------------

def _refuse_non_causal(is_causal: bool, attn_mask: Tensor | None) -> None:
    if not is_causal or attn_mask is not None:
        raise ValueError("Context parallelism shards causal attention only (is_causal=True, no attn_mask): the "
                         "load-balanced chunk order is only right for a causal mask. Set context_parallel_size=1.")


def _as_shards(local: tuple[Tensor, ...], like: DTensor) -> tuple[DTensor, ...]:
    return tuple(DTensor.from_local(t, like.device_mesh, like.placements, run_check=False) for t in local)


def _cpu_ring_forward(op: Any, args: tuple, kwargs: dict) -> tuple[DTensor, ...]:
    def run(query: DTensor, key: DTensor, value: DTensor, dropout_p: float = 0.0, is_causal: bool = False, *,
            attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[DTensor, ...]:
        _refuse_non_causal(is_causal, attn_mask)
        out, logsumexp, *_ = _attention._templated_ring_attention(
            query.device_mesh.get_group(), _SEQ_DIM, _aten._scaled_dot_product_flash_attention_for_cpu,
            query.to_local(), key.to_local(), value.to_local(), is_causal=True, dropout_p=dropout_p, scale=scale,
        )
        return _as_shards((out, logsumexp), query)

    return run(*args, **kwargs)


def _cpu_ring_backward(op: Any, args: tuple, kwargs: dict) -> tuple[DTensor, ...]:
    def run(grad_out: DTensor, query: DTensor, key: DTensor, value: DTensor, out: DTensor, logsumexp: DTensor,
            dropout_p: float, is_causal: bool, *, attn_mask: Tensor | None = None,
            scale: float | None = None) -> tuple[DTensor, ...]:
        _refuse_non_causal(is_causal, attn_mask)
        grads = _attention._templated_ring_attention_backward(
            query.device_mesh.get_group(), _SEQ_DIM, _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out.to_local(), grad_out_name="grad_out", query=query.to_local(), key=key.to_local(),
            value=value.to_local(), out=out.to_local(), logsumexp=logsumexp.to_local(), is_causal=True,
            dropout_p=dropout_p, scale=scale,
        )
        return _as_shards(tuple(grads[:3]), query)

    return run(*args, **kwargs)


_CPU_HANDLERS = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_ring_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_ring_backward,
}


@contextmanager
def ring_attention(rotate_method: RotateMethod) -> Generator[None, None, None]:
    """Within: attention on sequence-sharded DTensors runs as load-balanced ring attention, forward and backward.

    Re-entrant (a manual ``backward`` inside a step), and it leaves torch's global CP options as it found them.
    """
    dispatcher = DTensor._op_dispatcher
    if _cpu_ring_forward in dispatcher._custom_op_handlers.values():
        yield
        return
    handlers, options = dispatcher._custom_op_handlers, _attention._cp_options
    saved_options = (options.enable_load_balance, options.rotate_method)
    _enable_context_parallel_dispatcher()  # torch's CUDA-kernel handlers and their sharding rules
    # torch replaces the handler table with its import-time one; keep what others registered since.
    dispatcher._custom_op_handlers = {**handlers, **dispatcher._custom_op_handlers, **_CPU_HANDLERS}
    options.enable_load_balance = True  # the chunk order SequenceSharder makes
    _attention.set_rotate_method(rotate_method)
    try:
        yield
    finally:
        _disable_context_parallel_dispatcher()
        dispatcher._custom_op_handlers = handlers
        options.enable_load_balance, options.rotate_method = saved_options


# ---- per step: the batch, the buffers, the predictions -------------------------------------------

@per_simulated_rank
def load_balanced_shard(tensor: Tensor, rank: int, size: int, dim: int) -> Tensor:
    """CP rank ``rank``'s tokens of ``tensor``: chunks ``rank`` and ``2 * size - 1 - rank`` of ``dim``."""
    chunks = tensor.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def gather_sequence(tensor: Tensor, mesh: DeviceMesh, dim: int) -> Tensor:
    """``load_balanced_shard``'s inverse across the ``cp`` mesh: every rank gets the whole sequence, in order (no
    autograd)."""
    pairs = [torch.empty_like(tensor) for _ in range(mesh.size())]
    dist.all_gather(pairs, tensor.contiguous(), group=mesh.get_group())
    return _in_order(torch.cat(pairs, dim=dim), mesh.size(), dim)


class SequenceSharder:
    """Cuts each batch and the plan's position-indexed buffers to this CP rank's tokens.

    Args:
        model: the model whose ``plan.buffers`` are swapped for their shards during a step.
        mesh: the ``cp`` mesh.
        plan: what to cut.
        rotate_method: how key/value shards travel round the ring.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: ContextParallelPlan,
                 rotate_method: RotateMethod) -> None:
        self.mesh = mesh
        self.plan = plan
        self.rotate_method = rotate_method
        self._rank, self._size = mesh.get_local_rank(), mesh.size()
        self._buffers = {}
        for name, dim in plan.buffers.items():
            owner_name, _, attribute = name.rpartition(".")
            self._buffers[name] = (model.get_submodule(owner_name), attribute, dim)

    def shard(self, tensor: Tensor, dim: int) -> Tensor:
        """This rank's tokens of ``tensor``: chunks ``r`` and ``2 * cp - 1 - r`` of ``dim``."""
        return load_balanced_shard(tensor, self._rank, self._size, dim)

    def gather(self, tensor: Tensor, dim: int) -> Tensor:
        """The inverse of ``shard`` across the CP ranks: every rank gets the whole sequence, in order (no autograd)."""
        return gather_sequence(tensor, self.mesh, dim)

    def sequence_length(self, batch: Any) -> int:
        if not isinstance(batch, Mapping):
            raise TypeError(f"Context parallelism cuts the batch entries {sorted(self.plan.batch)} on their sequence "
                            f"dim, so the batch must be a mapping, not {type(batch).__name__}.")
        entries = {**self.plan.batch, **self.plan.whole_batch}
        lengths = {key: batch[key].shape[dim] for key, dim in entries.items() if key in batch}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"Context parallelism needs the batch entries {sorted(entries)} with one sequence "
                             f"length; got {lengths or 'none of them'}.")
        return next(iter(lengths.values()))

    @contextmanager
    def step(self, batch: Mapping[str, Any], seq_len: int) -> Generator[dict[str, Any], None, None]:
        """Yield this rank's share of ``batch``; meanwhile buffers hold this rank's rows and attention is ring
        attention."""
        local = {key: self.shard(value, self.plan.batch[key]) if key in self.plan.batch else value
                 for key, value in batch.items()}
        full_buffers = {name: getattr(owner, attribute) for name, (owner, attribute, _) in self._buffers.items()}
        for name, (owner, attribute, dim) in self._buffers.items():
            full = full_buffers[name]
            if seq_len > full.shape[dim]:
                raise ValueError(f"The batch has seq_len={seq_len}, but the model's {name} covers {full.shape[dim]} "
                                 "positions; raise the model's max_seq_len or shorten the data's seq_len.")
            setattr(owner, attribute, self.shard(full.narrow(dim, 0, seq_len), dim))
        try:
            with ring_attention(self.rotate_method):
                yield local
        finally:
            for name, (owner, attribute, _) in self._buffers.items():
                setattr(owner, attribute, full_buffers[name])
