"""What one test training run does: the typed spec that tests/support/train_worker.py runs.

A ``RunSpec`` holds the run's size (steps, batch size, processes) and one frozen group per concern: ``model``,
``data``, ``trainer`` (the Trainer and its strategy), ``checkpoints``, ``callbacks`` and ``drills`` (fault
injection). Tests build one (``RunSpec(steps=2, batch_size=4, trainer=TrainerSpec(clip=1.0))``) or derive one
(``spec.with_(batch_size=2, data={"seq_len": 64})``), ``tests/conftest.py::launch`` writes it as JSON for the
worker's ranks, and the worker reads it back with ``RunSpec.from_json``: a misspelled key, at any level, fails
there with a TypeError instead of being ignored. No torch or Lightning import here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CallbackSpec", "CheckpointSpec", "DataSpec", "DrillSpec", "ModelSpec", "RunSpec", "TrainerSpec"]


@dataclass(frozen=True)
class ModelSpec:
    """The module that trains: the tiny Llama (the worker's TINY) or a module nobody here wrote."""

    n_layers: int | None = None  # None: the worker's TINY (2)
    config: dict[str, Any] = field(default_factory=dict)  # LlamaConfig fields over TINY's
    self_sharded: bool = False  # a module that applies FSDP2 itself (SelfShardedLlama)
    # A module nobody here wrote, in place of the Llama (tests/support/user_modules.py says which and its keys); of
    # the spec it reads steps, batch_size, seed, accelerator, trainer.precision, trainer.strategy,
    # trainer.timeout_seconds, data.samples, data.seq_len, data.padded_labels and checkpoints.save_at, save_path and
    # resume_from.
    user_module: dict[str, Any] | None = None
    default_pipeline_loss: bool = False  # leave the pipeline loss to the strategy's default
    lr: float = 3e-3
    adamw: str = "auto"
    attention_kernel: str = "sdpa"
    attention_mask: str = "causal"  # LlamaModule's
    # LlamaModule's; the reference_run fixture's single process always takes "logits", so every parity test also
    # checks the chunked loss (in several chunks, the last one short) against the plain one
    cross_entropy: str = "chunked"
    loss_chunk_tokens: int = 48


@dataclass(frozen=True)
class DataSpec:
    """What the module trains on."""

    # AffineSequences; TextDataModule's offline corpus; or AffineSequences through a user's stateful stream that
    # keeps a per-rank position (train_worker.RankStream, data parallelism only)
    kind: Literal["affine", "text", "rank_stream"] = "affine"
    seq_len: int = 32
    samples: int = 512  # training sequences (affine data)
    padded_labels: bool = False  # uneven tails of -100 labels (AffineSequences(padded=True)), train and eval
    documents: bool = False  # samples carry document_ids of documents of uneven lengths (AffineSequences)
    record_sample_ids: bool = False  # record which samples each batch held ("sample_ids" of each step's record)


@dataclass(frozen=True)
class TrainerSpec:
    """The Trainer's loop and its strategy."""

    precision: str = "32-true"
    strategy: dict[str, Any] = field(default_factory=dict)  # TitanStrategy's arguments
    timeout_seconds: float = 60  # TitanStrategy's; short, so that a hang fails the test
    lightning_model_parallel: bool = False  # Lightning's ModelParallelStrategy instead of TitanStrategy
    float8_on_cpu: bool = False  # lift the strategy's refusal of float8 on CPU
    accumulate: int = 1  # accumulate_grad_batches
    clip: float | None = None  # gradient_clip_val
    validate: bool = False
    val_every: int | None = None  # val_check_interval when validating; None: at the last step
    evaluate: bool = False  # trainer.test and trainer.predict after fit
    progress_bar: bool = False


@dataclass(frozen=True)
class CheckpointSpec:
    """What the run saves and resumes from, and what it records about them."""

    save_at: int | None = None  # trainer.save_checkpoint(save_path) at this global step
    save_path: str | None = None
    resume_from: str | None = None  # fit's ckpt_path
    model_checkpoint: dict[str, Any] | None = None  # ModelCheckpoint's arguments, dirpath included
    rng_probe: bool = False  # record one draw of each generator a checkpoint restores
    log_removals: bool = False  # record which complete checkpoints existed at each removal ("removals")


@dataclass(frozen=True)
class CallbackSpec:
    """Callbacks beyond the worker's recorder."""

    lightning_callbacks: bool = False  # best-2 ModelCheckpoint and EarlyStopping on train_loss
    flight_recorder: dict[str, Any] | None = None  # FlightRecorder's arguments
    throughput: dict[str, Any] | None = None  # Throughput's arguments
    memory_probe_step: int | None = None  # measure this step's peak memory with MemTracker


@dataclass(frozen=True)
class DrillSpec:
    """Fault injection: each patches something only when asked for."""

    hang: dict[str, Any] | None = None  # Sabotage's hang drill
    # {"ranks": [r, ...], "step": k, "signal": "SIGKILL" | "SIGTERM"}: those ranks signal themselves as step k starts
    # (or, with "at": "backward", after its forward), in a run's first attempt only (not after a torchrun restart)
    interrupt: dict[str, Any] | None = None
    # torchft replica-group drills: [{"step": k, "file": path, "grace_s": s}, ...]: wait as step k starts (step 0: in
    # the run's set-up) until the file exists (another group has got there), then s seconds more; announce_files:
    # [{"step": k, "file": path}, ...]: rank 0 writes the file as step k starts (step 0: as the set-up begins);
    # record each rank's digest of its parameter shards after fit ("parameter_digest").
    wait_for_files: list[dict[str, Any]] = field(default_factory=list)
    announce_files: list[dict[str, Any]] = field(default_factory=list)
    record_parameter_digest: bool = False
    slow_writes_s: float = 0.0  # added to each DCP shard write
    kill_during_save: dict[str, int] | None = None  # {"rank": r, "save": n}: SIGKILL rank r in its n-th shard write
    # From the second save on the disk is full: "before" (it reports 1,000 bytes free) or "while" (a shard write
    # raises ENOSPC, as torch's writer does when the disk fills up).
    disk_full: str | None = None


@dataclass(frozen=True)
class RunSpec:
    """One training run of the tiny Llama under TitanStrategy; each field's default is the worker's."""

    steps: int  # optimizer steps (Trainer max_steps)
    batch_size: int  # per data-parallel rank
    devices: int = 1  # set by launch to its process count
    num_nodes: int = 1  # Trainer(num_nodes): launches of several torchrun agents (one per "node")
    seed: int = 0
    accelerator: str = "cpu"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    checkpoints: CheckpointSpec = field(default_factory=CheckpointSpec)
    callbacks: CallbackSpec = field(default_factory=CallbackSpec)
    drills: DrillSpec = field(default_factory=DrillSpec)
    # Set by tests.conftest.launch: each rank writes its threads' Python stacks to rank{N}.stacks this long after it
    # starts, so a launch that times out says where its ranks were.
    stacks_after_s: float | None = None

    def with_(self, **changes: Any) -> RunSpec:
        """``dataclasses.replace``, where a group may be given as a dict of the fields that change in it:
        ``spec.with_(steps=4, data={"seq_len": 64})`` keeps every other field of ``spec.data``. A misspelled
        field, at either level, raises TypeError."""
        for name, value in changes.items():
            if name in _GROUPS and isinstance(value, dict):
                changes[name] = dataclasses.replace(getattr(self, name), **value)
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): equal specs give equal text."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """The spec ``to_json`` wrote; an unknown key in it, or in one of its groups, raises TypeError."""
        values = json.loads(text)
        groups = {name: group(**values.pop(name)) for name, group in _GROUPS.items() if name in values}
        return cls(**values, **groups)


_GROUPS: dict[str, type] = {"model": ModelSpec, "data": DataSpec, "trainer": TrainerSpec,
                            "checkpoints": CheckpointSpec, "callbacks": CallbackSpec, "drills": DrillSpec}
