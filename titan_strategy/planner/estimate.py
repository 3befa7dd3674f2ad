"""Per-rank memory and step time of one 4-D layout, from the model's shape alone.

The activation sizes are counts of the tensors a Llama-style block keeps for backward, in bf16,
calibrated on measured single-GPU peaks (benchmarks/RESULTS.md: 'Planner vs measured peaks').
Step time is model FLOPs over an achievable MFU, plus the communication that does not hide behind
compute, stretched by the pipeline bubble. Every constant is named and says where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from titan_strategy.config.pipeline import PipelineConfig, ScheduleName
from titan_strategy.parallelize.activation_checkpoint import ACMode
from titan_strategy.parallelize.fsdp import fsdp_wraps
from titan_strategy.planner.hardware import GPU

__all__ = ["Job", "Layout", "ModelShape", "Estimate", "estimate", "activation_bytes_per_token", "kv_dim"]

GIB = 2**30
_BF16, _FP32 = 2, 4
# What compiled steps reached at the calibration shapes when this model was first fitted (1B: 56.4% MFU, 8B width:
# 55.2%; benchmarks/RESULTS.md, 2026-12-01 "GPU performance"). TP_EXPOSED below was fitted with it in place.
ACHIEVABLE_MFU = 0.55
# Smaller matmuls reach less of the peak. The efficiency of a microbatch's matmuls is modelled as
# w / (w + MATMUL_HALF_WORK) in units of (tokens x dim / tp) / 4096, normalized to the calibration runs
# (16,384 tokens x 2048 and 8,192 tokens x 4096: 8,192 units).
MATMUL_HALF_WORK = 1024
CALIBRATION_WORK = 8192
# Each microbatch crossing a stage boundary pays a send, a receive and the schedule's bookkeeping.
PP_MICROBATCH_OVERHEAD_S = 1e-3
# Tensorwise float8's whole-step gain at the 8B width when the fits were made (benchmarks/RESULTS.md, 2026-12-01
# "GPU performance"). Later steps gained more (up to 1.26x: 'Float8'), but not as a whole-step factor over the
# paper's layouts: with 1.25 the 70B FSDP32 x TP8 row (TP_EXPOSED is fitted to it) overshoots the paper's 876
# tokens/s/GPU by 13% ('Planner float8 factor'). A factor on the matmuls alone would model it honestly; until then
# the step factor stays where the fits were made.
FLOAT8_SPEEDUP = 1.08
# What a ring collective reaches of the link's bandwidth, and its latency per ring step.
COLLECTIVE_EFFICIENCY = 0.7
RING_STEP_LATENCY_S = 8e-6
# CP's ring passes key/value shards while attention computes; this share stays exposed.
CP_EXPOSED = 0.3
# The share of TP's collective time that the step waits for. Without AsyncTP some already hides: a compiled
# block waits on a collective only where its result is used, so in backward the input gradient's
# reduce-scatter runs under the weight gradient's matmul. AsyncTP also splits each forward matmul to overlap
# the all-gather feeding it. Both fitted, with the rest of this model fixed, to the TorchTitan paper's two
# 70B FSDP32 x TP8 rows (table 4): 829 tokens/s/GPU without AsyncTP, 876 with it.
TP_EXPOSED = {False: 0.63, True: 0.45}
# Bytes per logit (per token and vocabulary entry) alive at the loss. Compiled loss: the bf16 logits and
# their gradient. Eager loss adds the fp32 upcast and fp32 log-softmax: 15.7 GiB more on the 1B shape's
# 16,384 x 128,256 logits (RESULTS.md #8), 8 bytes each.
LOGIT_BYTES = {True: 4, False: 12}
# What an uncompiled block keeps beyond a compiled one, in bf16 values per token and dim: the 1B shape's
# eager run peaked 8.0 GiB above its compiled run (70.8 against 62.8 GiB, RESULTS.md #8; 16 blocks x
# 16,384 tokens x 2,048), that is 8 values.
EAGER_EXTRA_VALUES = 8
# Allocator fragmentation (reserved / allocated was 1.07-1.18 on the GPU) and the CUDA context + NCCL buffers.
FRAGMENTATION = 1.10
RUNTIME_GIB = 2.0
# Extra compute of recomputation, as a share of the step without AC: measured on the 1B shape (RESULTS.md #8:
# selective_op kept 91.6% of the speed, full 83.7%).
RECOMPUTE: dict[ACMode, float] = {"none": 0.0, "selective_op": 0.09, "selective_layer": 0.10, "full": 0.19}
# What full AC keeps per block and microbatch under FSDP, as a multiple of the block's input, without and with
# PP, beside the RoPE table copies and pipeline buffers counted on their own (``_memory``). Fitted on rehearsed
# ranks (benchmarks/RESULTS.md: 'Planner vs rehearsed ranks'; tests/test_planner.py): 1.3 without PP (the
# sequence all-gathers' outputs beside the block inputs), 1.0, the input alone, under PP.
FULL_AC_KEPT = {False: 1.3, True: 1.0}
# Bytes per parameter of a pipeline stage's unsharded gradients until FSDP reduces them at its last microbatch, at
# the rank's peak: on the first stage's rank the fp32 accumulation plus bf16 gradients not yet folded into it (405B
# first stages, rehearsed: 30.1 GiB for 15 blocks and the embedding, 6.24 B parameters after TP); on the last
# stage's rank, whose peak comes with fewer microbatches in flight, the fp32 accumulation (the PP8 and PP16 last
# stages' rehearsed peaks).
PP_UNSHARDED_GRADIENT_BYTES = {"first": 5.18, "last": 4.0}


@runtime_checkable
class ModelShape(Protocol):
    """What the planner reads of a Llama-style decoder (GQA attention, SwiGLU feed-forward, untied output
    projection): its shape and the model's own parameter and FLOP counts, which the planner never recomputes.

    ``llama_module``'s ``LlamaConfig`` is one; the planner imports nothing of the model's package.
    """

    # Read-only properties rather than attributes, so that a frozen dataclass's fields satisfy them.
    @property
    def dim(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def ffn_dim(self) -> int: ...

    @property
    def max_seq_len(self) -> int:
        """Rows of the RoPE table."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block."""

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """All parameters, or all but the embedding table (the untied output projection still counts)."""

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of training one token of a ``seq_len``-token sequence (forward, backward, no recompute)."""

    def block_flops_per_token(self, seq_len: int) -> float:
        """The share of ``flops_per_token`` that one transformer block does."""


def kv_dim(shape: ModelShape) -> int:
    """Width of the key (or the value) projection's output: the key/value heads' share of ``dim``."""
    return shape.dim // shape.n_heads * shape.n_kv_heads


def activation_bytes_per_token(shape: ModelShape, ac: str, compiled: bool = True, autocast: bool = False) -> float:
    """What one block keeps for backward per token, in bf16 values, by AC mode.

    No AC: norm inputs and outputs, q/k/v before and after RoPE, attention output, gate, up and their
    product (6 x dim + 2 x kv_dim + 3 x ffn_dim values); an eager block adds the fp32 copies its
    norms and RoPE keep (``EAGER_EXTRA_VALUES`` x dim). selective_op: attention's output and every
    other matmul's (q, v, gate, down: 3 x dim + kv_dim + ffn_dim, as an eager block's saved tensors show;
    a compiled block's measured peak fits 1.5 x ffn_dim). full: the block's input. selective_layer (every
    2nd block, the strategy's default): the mean of none and full.

    ``autocast`` (a single device, no FSDP): the residual stream stays fp32, so the residual-sized
    values a block keeps take twice the bytes: the two norm inputs without AC (and an eager block's
    two norm outputs), the block's input under selective_op and full AC.
    """
    d, kv, f = shape.dim, kv_dim(shape), shape.ffn_dim
    eager = 0 if compiled else EAGER_EXTRA_VALUES * d
    values = {"none": 6 * d + 2 * kv + 3 * f + eager, "selective_op": 3 * d + kv + (1.5 if compiled else 1.0) * f,
              "full": d}
    if autocast:
        fp32_extra = {"none": (2 if compiled else 4) * d, "selective_op": d, "full": d}
        values = {mode: value + fp32_extra[mode] for mode, value in values.items()}
    values["selective_layer"] = (values["none"] + values["full"]) / 2
    return _BF16 * values[ac]


@dataclass(frozen=True)
class Job:
    """What the user asks for: GPUs, their kind, the batch, and the recipe choices that are not layouts.

    ``compiled_blocks``: each block is compiled (TitanStrategy's ``compile``), which keeps fewer
    tensors for backward. ``compiled_loss``: the loss is compiled (``compile_loss``), so fp32 logits never
    materialize. ``async_tp``: TP's collectives overlap the matmuls (``async_tensor_parallel``).
    ``loss_chunk_tokens``: the output projection and the loss run together this many tokens at a time
    (``LlamaModule(cross_entropy="chunked")``), so only a chunk's logits exist; None: the whole logits do.
    """

    gpus: int
    gpus_per_node: int
    gpu: GPU
    seq_len: int
    global_batch_tokens: int
    compiled_blocks: bool = True
    compiled_loss: bool = True
    async_tp: bool = False
    loss_chunk_tokens: int | None = None


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    pp: int
    schedule: ScheduleName | None
    microbatches: int
    stages_per_rank: int
    ac: ACMode
    float8: bool

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp


@dataclass(frozen=True)
class Estimate:
    """Per-rank memory (GiB) and step time (s) of a layout, by part.

    Gradients and activations do not peak together: the strategy releases the last step's gradients
    before the forward, and backward frees activations as it makes gradients. So the peak holds the
    larger of the two working sets, besides the weights and optimizer state. Likewise the logits are
    freed before backward's recomputation window opens.
    """

    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    tokens_per_s_per_gpu: float = 0.0
    checkpoint_gib_per_rank: float = 0.0

    @property
    def peak_allocated_gib(self) -> float:
        return self.peak_of(self.memory)

    @staticmethod
    def peak_of(m: dict[str, float]) -> float:
        """The allocated peak of a memory breakdown."""
        working_set = max(m["activations"] + max(m["logits_loss"], m["recompute_window"]), m["gradients"])
        return (m["parameters"] + m["optimizer"] + m["bf16_weights"] + m["unsharded_gradients"] + m["pipeline_buffers"]
                + working_set)

    @property
    def peak_reserved_gib(self) -> float:
        """The caching allocator's peak: the allocated peak plus fragmentation (what torchtitan logs as memory)."""
        return self.peak_allocated_gib * FRAGMENTATION

    @property
    def memory_gib(self) -> float:
        """What must fit on the device: the reserved peak plus the runtime's own memory."""
        return self.peak_reserved_gib + RUNTIME_GIB

    @property
    def step_s(self) -> float:
        return self.time["step"]


def _logits_bytes(shape: ModelShape, layout: Layout, job: Job, microbatch_tokens: float) -> float:
    """What the loss of one microbatch adds on the last stage: its logits, with their gradient (and fp32 copies
    where the loss is not compiled); chunked, those of one chunk only (its math is always compiled on CUDA), and the
    output weight's bf16 gradient, which the chunked loss makes in forward."""
    vocab = shape.vocab_size / layout.tp
    if job.loss_chunk_tokens is None:
        return microbatch_tokens * vocab * LOGIT_BYTES[job.compiled_loss]
    return min(job.loss_chunk_tokens, microbatch_tokens) * vocab * LOGIT_BYTES[True] + vocab * shape.dim * _BF16


def _in_flight_microbatches(layout: Layout, pp_rank: int) -> float:
    """Microbatches whose activations pipeline rank ``pp_rank`` holds at once, in units of its layers."""
    pp, v, n = layout.pp, layout.stages_per_rank, layout.microbatches
    if pp == 1:
        return 1.0
    if layout.schedule in ("GPipe", "LoopedBFS"):
        return float(n)  # every forward before any backward
    if layout.schedule == "1F1B":
        return float(min(n, pp - pp_rank))  # rank r warms up pp - r microbatches
    if layout.schedule in ("ZBVZeroBubble", "DualPipeV"):
        return float(min(n, pp))  # rank 0 holds the first and the last stage
    # Interleaved: rank r warms up (v - 1) * pp + 2 * (pp - 1 - r) + 1 chunks of 1/v of its layers each.
    return min(n * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1) / v


def _rank_stages(shape: ModelShape, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """Blocks pipeline rank ``pp_rank`` holds, split and placed as the strategy does (``PipelineConfig.resolve``),
    and how many receive buffers per microbatch its stages hold.

    torch's pipeline stages allocate before the first step one buffer per microbatch for each activation a stage
    receives (every stage but the first) and for each gradient (every stage but the last), kept for the run.
    """
    if layout.pp == 1:
        return shape.n_layers, 0
    assert layout.schedule is not None
    pipeline = PipelineConfig(size=layout.pp, schedule=layout.schedule, microbatches=layout.microbatches,
                              stages_per_rank=layout.stages_per_rank).resolve(shape.n_layers)
    stages = pipeline.stages_of(pp_rank)
    receives = sum((stage > 0) + (stage < pipeline.num_stages - 1) for stage in stages)
    return sum(len(pipeline.blocks[stage]) for stage in stages), receives


def _bubble(layout: Layout) -> float:
    pp, v, n = layout.pp, layout.stages_per_rank, layout.microbatches
    if pp == 1:
        return 0.0
    if layout.schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (n + pp - 1)
    if layout.schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (pp - 1) / (v * n + pp - 1)
    # Zero-bubble schedules fill most of the bubble with weight-gradient work.
    return (pp - 1) / (3 * v * n + pp - 1)


def _partly_hidden(communication: float, compute: float) -> float:
    """What FSDP's prefetched collectives leave exposed: little while they are short against the compute
    they overlap, half of them once they are as long (they also slow the compute they share the GPU with).

    Checked against the TorchTitan paper's 8B on 128 H100s, FSDP, bf16, selective AC: 5,762 tokens/s/GPU
    published, 5,709 estimated (tests/test_planner.py).
    """
    return communication * communication / (communication + compute) if communication else 0.0


def _last_stage_share(shape: ModelShape, layout: Layout, seq_len: int) -> float:
    """How much longer the rank with the last pipeline stage computes than the mean rank: it also runs the
    output projection and the loss (the first stage's embedding lookup is nearly free), and all wait on it."""
    if layout.pp == 1:
        return 1.0
    block = shape.block_flops_per_token(seq_len)
    head = shape.flops_per_token(seq_len) - shape.n_layers * block  # the output projection and the final norm
    return (shape.n_layers / layout.pp * block + head) / ((shape.n_layers * block + head) / layout.pp)


def _matmul_efficiency(work: float) -> float:
    def raw(w: float) -> float:
        return w / (w + MATMUL_HALF_WORK)

    return min(raw(work) / raw(CALIBRATION_WORK), 1.0)


def _ring_time(bytes_per_rank: float, ranks: int, bandwidth_gbps: float, calls: int) -> float:
    if ranks == 1:
        return 0.0
    transfer = bytes_per_rank * (ranks - 1) / ranks / (bandwidth_gbps * 1e9 * COLLECTIVE_EFFICIENCY)
    return transfer + calls * (ranks - 1) * RING_STEP_LATENCY_S


PipelineRank = Literal["busiest", "first", "last"]


def _memory(shape: ModelShape, layout: Layout, job: Job, pp_rank: int) -> dict[str, float]:
    """What pipeline rank ``pp_rank`` holds at its peak, by part (GiB); without PP, every rank."""
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    embed = shape.vocab_size * shape.dim
    layers, receives = _rank_stages(shape, layout, pp_rank)
    # Its blocks, plus the embedding on the first stage and the output projection on the last (one rank: both).
    rank_params = (layers * shape.block_params + embed * (first + last)) / layout.tp
    shards = layout.dp_shard * layout.cp
    sequences = job.global_batch_tokens / job.seq_len / layout.dp  # per data-parallel rank and step
    microbatch_tokens = sequences / layout.microbatches * job.seq_len / layout.cp  # this rank's, per microbatch
    single_device = not fsdp_wraps(layout.world)
    if single_device:
        # No FSDP: autocast casts each weight for its matmul. A compiled block's backward casts its weights
        # again (the partitioner recomputes the cheap cast); eager blocks and the output projection keep
        # their bf16 copies for backward. (With TritonAdamW the strategy holds bf16 weights and gradients next
        # to fp32 masters instead of casting: the same bytes within 1.5% at the 1B shape, RESULTS.md.)
        bf16_weights = (0 if job.compiled_blocks else shape.n_layers * shape.block_params * _BF16) + embed * _BF16
    else:  # FSDP's gathered units; under PP a stage stays gathered
        bf16_weights = shape.block_params / layout.tp * _BF16 * 2 if layout.pp == 1 else rank_params * _BF16
        if layout.float8:
            bf16_weights /= 2
    # Under sequence parallelism the two norm outputs are all-gathered to the full sequence before the
    # column-parallel matmuls, and those gathered inputs are what their backward keeps.
    gathered_inputs = 2 * shape.dim * _BF16 * (1 - 1 / layout.tp)
    # selective_op keeps the feed-forward's last matmul output (w2, every other matmul), which under TP is the
    # row-parallel partial sum of the whole width for the whole sequence, before its reduce-scatter (an eager
    # TP block's saved tensors show it).
    partial_sums = shape.dim * _BF16 * (1 - 1 / layout.tp)
    # FSDP's mixed precision casts each block's floating inputs, the whole RoPE table among them, at every call.
    # An eager checkpointed block keeps its inputs for the recomputation, so one bf16 copy of the table (max_seq_len
    # rows of head_dim cos/sin values) per block and microbatch in flight; a compiled block keeps only the rows it
    # used, and a block without AC only its RoPE's products.
    checkpointed = {"none": 0.0, "selective_layer": 0.5}.get(layout.ac, 1.0)
    rope_copy = 0.0 if single_device or job.compiled_blocks else \
        checkpointed * shape.max_seq_len * shape.dim // shape.n_heads * _BF16
    kept_by_full_ac = 1.0 if single_device else FULL_AC_KEPT[layout.pp > 1]

    def saved_per_token(ac: str) -> float:
        saved = activation_bytes_per_token(shape, ac, job.compiled_blocks, autocast=single_device) / layout.tp
        return saved * (kept_by_full_ac if ac == "full" else 1.0) + (gathered_inputs if ac == "none" else 0.0) + (
            partial_sums if ac == "selective_op" else 0.0)

    in_flight = _in_flight_microbatches(layout, pp_rank)
    activations = layers * in_flight * (microbatch_tokens * saved_per_token(layout.ac) + rope_copy)
    # Backward recomputes what AC dropped of one block at a time, once the logits are gone: a checkpointed block
    # whole, the cheap rest under selective_op (what shows once a chunked loss leaves no logits peak above it).
    dropped = {"full": saved_per_token("none"), "selective_layer": saved_per_token("none"),
               "selective_op": saved_per_token("none") - saved_per_token("selective_op")}
    recompute_window = microbatch_tokens * dropped.get(layout.ac, 0.0)
    logits = _logits_bytes(shape, layout, job, microbatch_tokens) if last else 0.0
    # A stage boundary carries the residual stream, sequence-sharded over TP.
    receive_buffers = receives * layout.microbatches * microbatch_tokens / layout.tp * shape.dim * _BF16
    return {
        "parameters": rank_params / shards * _FP32 / GIB,
        "gradients": rank_params / shards * _FP32 / GIB,
        "optimizer": rank_params / shards * 2 * _FP32 / GIB,
        "bf16_weights": bf16_weights / GIB,
        # Under PP, torch's schedules defer FSDP's reduce-scatter to a stage's last microbatch: until then
        # the stage's gradients accumulate unsharded.
        "unsharded_gradients": (rank_params * PP_UNSHARDED_GRADIENT_BYTES["last" if last else "first"]
                                if layout.pp > 1 else 0.0) / GIB,
        "pipeline_buffers": receive_buffers / GIB,
        "activations": activations / GIB,
        "logits_loss": logits / GIB,
        "recompute_window": recompute_window / GIB,
    }


def estimate(shape: ModelShape, layout: Layout, job: Job, pipeline_rank: PipelineRank = "busiest") -> Estimate:
    """Per-rank memory and step time of ``layout`` for ``job``; the layout's degrees must already fit.

    Memory is that of a rank of the first or the last pipeline stage (the first holds the most microbatches in
    flight, the last the logits), or of whichever of the two peaks higher. Step time is the pipeline's.
    """
    gpu, seq = job.gpu, job.seq_len
    ranks = {"first": [0], "last": [layout.pp - 1], "busiest": [0, layout.pp - 1]}[pipeline_rank]
    memory = max((_memory(shape, layout, job, rank) for rank in ranks), key=Estimate.peak_of)
    # Communication is the mean rank's: its layers, and the embedding or output projection.
    layers = shape.n_layers / layout.pp
    embed = shape.vocab_size * shape.dim
    rank_params = (layers * shape.block_params + (2 * embed if layout.pp == 1 else embed)) / layout.tp
    shards = layout.dp_shard * layout.cp
    sequences = job.global_batch_tokens / seq / layout.dp  # per data-parallel rank and step
    microbatch_tokens = sequences / layout.microbatches * seq / layout.cp  # this rank's tokens in one microbatch
    tokens_per_gpu = job.global_batch_tokens / job.gpus
    flops = tokens_per_gpu * shape.flops_per_token(seq) * (1 + RECOMPUTE[layout.ac])
    mfu = ACHIEVABLE_MFU * _matmul_efficiency(microbatch_tokens * shape.dim / layout.tp / 4096)
    compute = flops / (mfu * gpu.peak_bf16_tflops * 1e12) / (FLOAT8_SPEEDUP if layout.float8 else 1.0)
    compute *= _last_stage_share(shape, layout, seq)
    # Bandwidth of a group: ranks are placed tp innermost, then cp, dp_shard, dp_replicate, pp outermost.
    span = {"tp": layout.tp, "cp": layout.tp * layout.cp, "fsdp": layout.tp * layout.cp * layout.dp_shard,
            "dp_replicate": layout.tp * layout.cp * layout.dp, "pp": layout.world}

    def link(group: str) -> float:
        return gpu.intra_node_gbps if span[group] <= job.gpus_per_node else gpu.inter_node_gbps

    units = layers + (1 if layout.pp > 1 else 2)
    # FSDP: all-gather forward and backward (bf16; float8 weights under tensorwise) and a fp32 reduce-scatter.
    gathered_bytes = rank_params * (1 if layout.float8 else _BF16) * (1 if layout.pp > 1 else 2)
    fsdp = _ring_time(gathered_bytes + rank_params * _FP32, shards, link("fsdp"), calls=3 * int(units))
    hsdp = _ring_time(2 * rank_params / shards * _FP32, layout.dp_replicate, link("dp_replicate"), calls=int(units))
    # TP with SP: per block 2 all-gathers and 2 reduce-scatters of the residual forward, as many backward,
    # and the forward's again where AC recomputes it.
    tp_calls = 8 if layout.ac == "none" else 12
    tp_bytes = tp_calls * layers * sequences * seq / layout.cp * shape.dim * _BF16
    tp = _ring_time(tp_bytes, layout.tp, link("tp"), calls=int(tp_calls * layers * layout.microbatches))
    # CP: the key/value shards go round the ring once forward and (with their gradients) twice backward.
    cp_bytes = 3 * 2 * layers * sequences * seq / layout.cp * kv_dim(shape) * _BF16 / layout.tp
    cp = _ring_time(cp_bytes * layout.cp, layout.cp, link("cp"), calls=int(3 * layers * layout.microbatches))
    # PP: every microbatch crosses each stage boundary forward and backward, with its activation.
    boundary_bytes = microbatch_tokens / layout.tp * shape.dim * _BF16
    pp = 0.0 if layout.pp == 1 else 2 * layout.microbatches * layout.stages_per_rank * (
        PP_MICROBATCH_OVERHEAD_S + boundary_bytes / (link("pp") * 1e9 * COLLECTIVE_EFFICIENCY))
    exposed = {"fsdp": _partly_hidden(fsdp, compute), "hsdp": _partly_hidden(hsdp, compute),
               "tp": tp * TP_EXPOSED[job.async_tp],
               "cp": CP_EXPOSED * cp, "pp": pp}
    busy = compute + sum(exposed.values())
    step = busy / (1 - _bubble(layout))
    time = {"compute": compute, **{f"{name}_exposed": value for name, value in exposed.items()},
            "bubble": step - busy, "step": step}
    checkpoint = rank_params / shards * 3 * _FP32 / GIB  # weights + AdamW moments, fp32
    return Estimate(memory=memory, time=time, tokens_per_s_per_gpu=tokens_per_gpu / step,
                    checkpoint_gib_per_rank=checkpoint)
