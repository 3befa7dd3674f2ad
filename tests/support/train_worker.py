"""One training run under TitanStrategy, launched by the tests (tests/support/fork_launch.py, torchrun or Lightning's
launcher).

    python tests/support/fork_launch.py 2 SPEC.json OUT_DIR
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 tests/support/train_worker.py \
        SPEC.json OUT_DIR

SPEC.json is a ``tests.support.run_spec.RunSpec`` (``RunSpec.to_json``).

Every rank writes OUT_DIR/rank{N}.json with the logged ``train_loss`` (and ``grad_norm``) of each
optimizer step, so tests can compare runs of different layouts with a single-process run. A rank
that fails writes OUT_DIR/rank{N}.error instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import faulthandler
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

import titan_strategy.checkpoint.io as checkpoint_io
from llama_module import LlamaConfig, LlamaModule, TextDataModule
from tests.support.run_spec import DrillSpec, RunSpec
from titan_strategy import FlightRecorder, Throughput, TitanStrategy
from titan_strategy.config.float8 import Float8Config
from titan_strategy.parallelize.cuda_graph import graphed_call

# 8 query and 4 kv heads: grouped-query attention that still splits 4 ways under tensor parallelism.
TINY = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=128, max_seq_len=64)


class AffineSequences(Dataset):
    """Learnable, deterministic sequences: token[t+1] = (5 * token[t] + 3) mod vocab, random starts.

    With ``padded`` the labels of sample i end in a tail of (11 i mod 3/4 of seq_len) labels of -100, so the
    samples of a batch, and the ranks and microbatches that split it, hold uneven numbers of labelled tokens.
    With ``documents`` each sample is cut into documents of 3 to 11 tokens, in a pattern that differs from
    sample to sample, and says so in ``document_ids``.
    """

    def __init__(self, count: int, seq_len: int, vocab: int, seed: int = 1234, with_ids: bool = False,
                 padded: bool = False, documents: bool = False) -> None:
        self.with_ids = with_ids  # each sample also carries its index, "sample_id", for tests that check the order
        self.padded = padded
        self.documents = documents
        starts = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
        tokens = [starts]
        for _ in range(seq_len):
            tokens.append((5 * tokens[-1] + 3) % vocab)
        self.tokens = torch.stack(tokens, dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.tokens[index]
        labels = window[1:].clone()
        if self.padded:
            labels[len(labels) - (11 * index) % (3 * len(labels) // 4):] = -100
        sample = {"input_ids": window[:-1], "labels": labels}
        if self.documents:
            sample["document_ids"] = self._document_ids(index, len(labels))
        return {**sample, "sample_id": torch.tensor(index)} if self.with_ids else sample


    @staticmethod
    def _document_ids(index: int, seq_len: int) -> torch.Tensor:
        lengths, total = [], 0
        while total < seq_len:
            lengths.append(3 + (5 * index + 3 * len(lengths)) % 9)
            total += lengths[-1]
        return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq_len]


class RankStream(IterableDataset):
    """A user's stream with a per-rank position (``state_dict``), as torchdata's StatefulDataLoader keeps one: rank
    r of n reads samples r, r + n, ... and counts the ones it has handed out."""

    def __init__(self, samples: Dataset, rank: int, ranks: int) -> None:
        self.samples, self.rank, self.ranks = samples, rank, ranks
        self.read = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for index in range(self.rank + self.read * self.ranks, len(self.samples), self.ranks):
            self.read += 1
            yield self.samples[index]

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.read = state["read"]


class StatefulLoader(DataLoader):
    """A DataLoader whose position is its dataset's (Lightning saves a loader's state_dict, not a dataset's)."""

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


class SelfShardedLlama(LlamaModule):
    """A module in Lightning ModelParallelStrategy style: it applies FSDP2 itself in configure_model."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    parallel_plan = None  # type: ignore[assignment]  # declares no plan, so the strategy leaves it alone


class DefaultPipelineLoss(LlamaModule):
    """Leaves the pipeline loss to TitanStrategy's default (token cross-entropy of the last stage's logits)."""

    pipeline_loss = None  # type: ignore[assignment]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs, cross_entropy="logits")


def _lightning_callbacks(out_dir: Path) -> list[Callback]:
    """Callbacks that read ``train_loss``: best-k checkpoints and early stopping at every epoch end."""
    return [ModelCheckpoint(dirpath=out_dir / "checkpoints", monitor="train_loss", save_top_k=2, every_n_train_steps=2),
            EarlyStopping(monitor="train_loss", patience=0, check_on_train_epoch_end=True)]


def _pipeline_runner(trainer: L.Trainer) -> Any:
    """The strategy's pipeline (its ``stage_modules``), or None without pipeline parallelism."""
    runtime = getattr(trainer.strategy, "runtime", None)
    return runtime.pipeline if runtime is not None else None


def _validation_loader(spec: RunSpec) -> DataLoader:
    sequences = AffineSequences(64, spec.data.seq_len, TINY.vocab_size, seed=99, padded=spec.data.padded_labels,
                                documents=spec.data.documents)
    return DataLoader(sequences, batch_size=spec.batch_size)


def _evaluate(trainer: L.Trainer, model: L.LightningModule, spec: RunSpec) -> dict[str, Any]:
    """trainer.test and trainer.predict after fit, on the validation sequences."""
    loader = _validation_loader(spec)
    [tested] = trainer.test(model, dataloaders=loader, verbose=False)
    predictions = trainer.predict(model, dataloaders=loader)
    return {"test_loss": tested["test_loss"],
            "prediction_shape": list(predictions[0].shape),
            "prediction_abs_sum": float(sum(p.double().abs().sum() for p in predictions))}


class RemovalLog:
    """Which complete checkpoints existed each time one named ``*.ckpt`` was removed (patches the removal)."""

    def __init__(self) -> None:
        self.removals: list[dict[str, Any]] = []
        remove = checkpoint_io._remove

        def logged(path: Path) -> None:
            if path.suffix == ".ckpt":
                complete = [p.name for p in path.parent.glob("*.ckpt")
                            if p != path and (p / "titan_checkpoint.json").is_file()]
                self.removals.append({"removed": path.name, "complete": sorted(complete)})
            remove(path)

        checkpoint_io._remove = logged


def _interfere_with_writes(slow_s: float, kill: dict[str, int] | None, disk_full: str | None) -> None:
    """Make each DCP shard write take ``slow_s`` longer; SIGKILL rank ``kill["rank"]`` in its ``kill["save"]``-th;
    fill the disk from the second save on (``DrillSpec.disk_full``)."""
    write_data = dcp.FileSystemWriter.write_data
    writes = 0

    def interfered(self: dcp.FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        nonlocal writes
        writes += 1
        if kill is not None and int(os.environ["RANK"]) == kill["rank"] and writes == kill["save"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if disk_full == "while" and writes >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        time.sleep(slow_s)
        return write_data(self, *args, **kwargs)

    dcp.FileSystemWriter.write_data = interfered
    if disk_full == "before":
        checkpoint_io.shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000)


class Sabotage(Callback):
    """Hang drills: at training step ``step`` rank ``rank`` skips its next ``torch.distributed.<skip>`` call
    (and writes which group it skipped to OUT_DIR/skipped.json), or sleeps ``stall_s`` after the forward of
    its first pipeline stage (before that stage sends its activations), or of the whole model, or sends
    itself ``signal`` and writes torch's own pickled trace to OUT_DIR/native/nccl_trace_rank_N."""

    def __init__(self, drill: dict[str, Any], out_dir: Path) -> None:
        self.drill = drill
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank != self.drill["rank"] or trainer.global_step + 1 != self.drill["step"]:
            return
        if "skip" in self.drill:
            self._skip_next(self.drill["skip"])
        elif "signal" in self.drill:
            os.kill(os.getpid(), signal.Signals[self.drill["signal"]])
            native = self.out_dir / "native"
            native.mkdir(exist_ok=True)
            c10d_ext = torch._C._distributed_c10d
            # torch 2.11 keeps NCCL's entries in a recorder of their own, the one its timeout dump writes.
            native_dump = getattr(c10d_ext, "_dump_nccl_trace", None) if trainer.strategy.root_device.type == "cuda" \
                else None
            (native / f"nccl_trace_rank_{trainer.global_rank}").write_bytes((native_dump or c10d_ext._dump_fr_trace)())
        else:
            pipeline = _pipeline_runner(trainer)
            module = pipeline.stage_modules[0] if pipeline is not None else pl_module
            module.register_forward_hook(lambda *_: time.sleep(self.drill["stall_s"]))

    def _skip_next(self, op: str) -> None:
        original = getattr(dist, op)

        def skipped(*args: Any, group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
            setattr(dist, op, original)
            group = group or c10d._get_default_group()
            (self.out_dir / "skipped.json").write_text(json.dumps(
                {"op": op, "group": c10d._world.pg_names[group], "ranks": dist.get_process_group_ranks(group)}))

        setattr(dist, op, skipped)


class Interrupt(Callback):
    """``DrillSpec.interrupt``: a preemption (SIGTERM) or a dead rank (SIGKILL) at the start of a step."""

    def __init__(self, interrupt: dict[str, Any]) -> None:
        self.interrupt = interrupt

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.interrupt.get("at", "batch_start") == "batch_start":
            self._maybe_signal(trainer)

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        if self.interrupt.get("at") == "backward":
            self._maybe_signal(trainer)

    def _maybe_signal(self, trainer: L.Trainer) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank in self.interrupt["ranks"] and \
                trainer.global_step + 1 == self.interrupt["step"]:
            os.kill(os.getpid(), signal.Signals[self.interrupt["signal"]])


class RejoinGate(Callback):
    """``DrillSpec.wait_for_files`` and ``announce_files``: a replica group waits at a step until another one has got
    somewhere, so that the groups meet in the step the drill needs (the first, or one before the run ends)."""

    def __init__(self, wait_for_files: list[dict[str, Any]], announce_files: list[dict[str, Any]]) -> None:
        self.gates = {gate["step"]: gate for gate in wait_for_files}
        self.announcements = {announcement["step"]: announcement["file"] for announcement in announce_files}

    def setup(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._announce_and_wait(trainer, 0)  # step 0: before the strategy's set-up (a torchft group's first quorum)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._announce_and_wait(trainer, trainer.global_step + 1)

    def _announce_and_wait(self, trainer: L.Trainer, step: int) -> None:
        if step in self.announcements and trainer.global_rank == 0:
            Path(self.announcements[step]).touch()
        self._wait(self.gates.get(step))

    @staticmethod
    def _wait(gate: dict[str, Any] | None) -> None:
        if gate is None:
            return
        deadline = time.monotonic() + gate.get("timeout_s", 120)
        while not Path(gate["file"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(gate.get("grace_s", 0))  # the relaunched group's setup reaches its quorum request meanwhile


COUNTED_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                 "on_before_zero_grad", "on_before_optimizer_step", "on_validation_batch_end", "on_validation_end")


class Recorder(Callback):
    """Collects what Lightning logged at each optimizer step and how often each hook ran; saves a
    checkpoint when asked."""

    def __init__(self, save_at: int | None, save_path: str | None, rng_probe: bool = False) -> None:
        self.steps: list[dict[str, float]] = []
        self.rng_probe = rng_probe
        self.val_losses: list[float] = []
        self.hook_calls = dict.fromkeys(COUNTED_HOOKS, 0)
        self.training_mode_after_validation: list[bool] = []
        self.grads_alive_after_forward: list[bool] = []
        self.param_dtypes_in_training: list[str] = []
        self.save_at = save_at
        self.save_path = save_path
        for hook in COUNTED_HOOKS:
            setattr(self, hook, self._counter(hook, getattr(self, hook)))

    def _counter(self, hook: str, method: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.hook_calls[hook] += 1
            return method(*args, **kwargs)

        return counted

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        metrics = trainer.callback_metrics
        record = {"step": trainer.global_step, "train_loss": float(metrics["train_loss"]), "time": time.monotonic()}
        if "sample_id" in batch:
            record["sample_ids"] = batch["sample_id"].tolist()
        stepped = not self.steps or self.steps[-1]["step"] != trainer.global_step
        if stepped and "grad_norm" in metrics:  # logged by the optimizer step this batch completed
            record["grad_norm"] = float(metrics["grad_norm"])
        if self.rng_probe:  # one draw from each generator a checkpoint restores
            record["rng"] = [torch.rand(1).item(), random.random(), float(np.random.rand())]
        self.steps.append(record)
        if not self.param_dtypes_in_training:
            self.param_dtypes_in_training = sorted({str(p.dtype) for p in pl_module.parameters()})
        if self.save_at is not None and trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.save_path)

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # Lightning zeroes after the window's first forward: were the last window's gradients still held?
        self.grads_alive_after_forward.append(any(p.grad is not None for p in pl_module.parameters()))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.val_losses:  # every module (pipeline stages included) is back in training mode
            stages = _pipeline_runner(trainer)
            modules = [*pl_module.modules(),
                       *(m for part in (stages.stage_modules if stages else []) for m in part.modules())]
            self.training_mode_after_validation.append(all(m.training for m in modules))


class MemoryProbe(Callback):
    """Peak memory of one optimizer step, counted by torch's MemTracker, which follows every tensor storage
    (CPU ones too, where the allocator keeps no statistics). Take a step after the first: AdamW's state exists."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.tracker: Any = None
        self.peak_bytes: int | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step and self.tracker is None:
            from torch.distributed._tools.mem_tracker import MemTracker

            self.tracker = MemTracker()
            self.tracker.track_external(pl_module, *trainer.optimizers)
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.tracker is not None and self.peak_bytes is None:
            self.tracker.__exit__(None, None, None)
            self.peak_bytes = sum(device["Total"] for device in self.tracker.get_tracker_snapshot("peak").values())


@dataclasses.dataclass
class Probes:
    """The callbacks and patches whose findings go into the rank's record."""

    recorder: Recorder
    throughput: Throughput | None = None
    memory_probe: MemoryProbe | None = None
    removal_log: RemovalLog | None = None


def _strategy(spec: RunSpec) -> Any:
    settings = spec.trainer
    if settings.float8_on_cpu:
        # torchao's float8 matmuls run on CPU too (slowly): the strategy refuses them there as pointless, but a
        # test can check how float8 composes with TP and FSDP on gloo this way.
        Float8Config.check_device = lambda self, device: None
    if settings.lightning_model_parallel:
        return ModelParallelStrategy(data_parallel_size=spec.devices, tensor_parallel_size=1)
    # Short, so that a hang fails the test; compiling runs may ask for longer (cold inductor cache).
    return TitanStrategy(**settings.strategy, timeout_seconds=settings.timeout_seconds)


def _drill_callbacks(drills: DrillSpec, out_dir: Path) -> list[Callback]:
    callbacks: list[Callback] = []
    if drills.hang is not None:
        callbacks.append(Sabotage(drills.hang, out_dir))
    if drills.interrupt is not None:
        callbacks.append(Interrupt(drills.interrupt))
    if drills.wait_for_files or drills.announce_files:
        callbacks.append(RejoinGate(drills.wait_for_files, drills.announce_files))
    return callbacks


def _callbacks(spec: RunSpec, out_dir: Path) -> tuple[list[Callback], Probes]:
    """The recorder, the callbacks ``spec`` asks for, its drills, then the probes (in that order)."""
    checkpoints, wanted = spec.checkpoints, spec.callbacks
    probes = Probes(Recorder(checkpoints.save_at, checkpoints.save_path, checkpoints.rng_probe))
    callbacks = [probes.recorder, *(_lightning_callbacks(out_dir) if wanted.lightning_callbacks else [])]
    if checkpoints.model_checkpoint is not None:  # ModelCheckpoint's arguments, dirpath included
        callbacks.append(ModelCheckpoint(**checkpoints.model_checkpoint))
    if wanted.flight_recorder is not None:  # FlightRecorder's arguments; dumps go to OUT_DIR/flight_recorder
        callbacks.append(FlightRecorder(**wanted.flight_recorder))
    callbacks += _drill_callbacks(spec.drills, out_dir)
    if wanted.throughput is not None:
        probes.throughput = Throughput(**wanted.throughput)
    if wanted.memory_probe_step is not None:
        probes.memory_probe = MemoryProbe(wanted.memory_probe_step)
    callbacks += [callback for callback in (probes.throughput, probes.memory_probe) if callback is not None]
    return callbacks, probes


def _patch_checkpoint_io(spec: RunSpec, probes: Probes) -> None:
    """Log removals and interfere with shard writes, as ``spec`` asks."""
    drills = spec.drills
    if spec.checkpoints.log_removals:
        probes.removal_log = RemovalLog()
    if drills.slow_writes_s or drills.kill_during_save or drills.disk_full:
        _interfere_with_writes(drills.slow_writes_s, drills.kill_during_save, drills.disk_full)


def _trainer(spec: RunSpec, strategy: Any, callbacks: list[Callback], out_dir: Path) -> L.Trainer:
    settings = spec.trainer
    validation_interval = spec.steps if settings.val_every is None else settings.val_every
    return L.Trainer(
        accelerator=spec.accelerator, devices=spec.devices, num_nodes=spec.num_nodes, strategy=strategy,
        precision=settings.precision,
        max_steps=spec.steps, accumulate_grad_batches=settings.accumulate,
        gradient_clip_val=settings.clip, callbacks=callbacks, logger=False,
        enable_checkpointing=spec.callbacks.lightning_callbacks or spec.checkpoints.model_checkpoint is not None,
        enable_progress_bar=settings.progress_bar,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2 if settings.validate else 0,
        limit_test_batches=2, limit_predict_batches=2,
        val_check_interval=validation_interval if settings.validate else None,
        default_root_dir=str(out_dir),
    )


def _module(spec: RunSpec) -> LlamaModule:
    """The tiny Llama of ``spec.model`` (its vocabulary the text tokenizer's for text data)."""
    wanted = spec.model
    module_cls = SelfShardedLlama if wanted.self_sharded else \
        DefaultPipelineLoss if wanted.default_pipeline_loss else LlamaModule
    model_args = {"lr": wanted.lr, "warmup_steps": 2, "decay_steps": 100, "adamw": wanted.adamw,
                  "attention_kernel": wanted.attention_kernel, "attention_mask": wanted.attention_mask,
                  # the strategy's default pipeline loss takes the last stage's logits (the module says so itself)
                  **({} if wanted.default_pipeline_loss else {"cross_entropy": wanted.cross_entropy}),
                  "loss_chunk_tokens": wanted.loss_chunk_tokens}
    if spec.data.kind == "text":
        return module_cls(model=LlamaConfig(**{**TINY.__dict__, "vocab_size": 8448}), **model_args)
    n_layers = TINY.n_layers if wanted.n_layers is None else wanted.n_layers
    return module_cls(model=LlamaConfig(**{**TINY.__dict__, "n_layers": n_layers, **wanted.config}), **model_args)


def _train_loader(spec: RunSpec) -> DataLoader:
    data = spec.data
    samples = AffineSequences(data.samples, data.seq_len, TINY.vocab_size, with_ids=data.record_sample_ids,
                              padded=data.padded_labels, documents=data.documents)
    if data.kind == "rank_stream":  # a pure data-parallel run: the process's rank is its data-parallel rank
        stream = RankStream(samples, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        return StatefulLoader(stream, batch_size=spec.batch_size)
    return DataLoader(samples, batch_size=spec.batch_size)


def _fit(trainer: L.Trainer, model: LlamaModule, spec: RunSpec) -> None:
    resume_from = spec.checkpoints.resume_from
    if spec.data.kind == "text":
        data = TextDataModule(source="offline", seq_len=32, batch_size=spec.batch_size, val_batches=0)
        trainer.fit(model, datamodule=data, ckpt_path=resume_from)
    else:
        trainer.fit(model, train_dataloaders=_train_loader(spec), val_dataloaders=_validation_loader(spec),
                    ckpt_path=resume_from)


def _fit_record(trainer: L.Trainer, model: LlamaModule, recorder: Recorder) -> dict[str, Any]:
    """What the recorder saw during fit, and the trainer's state after it."""
    return {"steps": recorder.steps, "val_losses": recorder.val_losses, "world_size": trainer.world_size,
            "hook_calls": recorder.hook_calls,
            "training_mode_after_validation": recorder.training_mode_after_validation,
            "grads_alive_after_forward": recorder.grads_alive_after_forward,
            "param_dtypes_in_training": recorder.param_dtypes_in_training,
            "param_dtypes_after_fit": sorted({str(p.dtype) for p in model.parameters()}),
            "progress_bar_metrics": sorted(trainer.progress_bar_metrics), "global_step": trainer.global_step,
            "batch_rank": trainer.strategy.distributed_sampler_kwargs["rank"] if trainer.world_size > 1 else 0,
            "callbacks": [type(c).__name__ for c in trainer.callbacks]}


def _parameter_digest(model: LlamaModule) -> str:
    """Bitwise: the sha256 of this rank's parameter shards, in order."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _probe_record(spec: RunSpec, trainer: L.Trainer, model: LlamaModule, probes: Probes) -> dict[str, Any]:
    """What the probes ``spec`` asked for found, and what the graphs and best-k checkpoints ended as."""
    result: dict[str, Any] = {}
    if probes.removal_log is not None:
        result["removals"] = probes.removal_log.removals
    if spec.drills.record_parameter_digest:
        result["parameter_digest"] = _parameter_digest(model)
    if probes.memory_probe is not None:
        result["peak_memory_bytes"] = probes.memory_probe.peak_bytes
    graphed = graphed_call(getattr(model, "model", None))
    if graphed is not None and graphed.replays:  # cuda_graphs=True
        result["graph_replays"] = graphed.replays  # training forwards that replayed the graphs
        result["graphs_released"] = graphed.captured is None  # by the strategy's teardown
    if probes.throughput is not None:
        result["throughput"] = [dataclasses.asdict(window) | window.metrics() for window in probes.throughput.windows]
    if spec.callbacks.lightning_callbacks:
        checkpoint = trainer.checkpoint_callback
        result |= {"best_model_score": float(checkpoint.best_model_score),
                   "best_k_models": sorted(Path(path).name for path in checkpoint.best_k_models)}
    return result


def _leave_together() -> None:
    """A rank that tears its gloo connections down while another still talks can make that one fail (suspected
    behind a rank-0 SIGABRT seen once in CI, after its results were written)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(spec: RunSpec, out_dir: Path) -> None:
    """Train the tiny Llama as ``spec`` says (then test and predict, if asked) and write this rank's record."""
    L.seed_everything(spec.seed, verbose=False)
    strategy = _strategy(spec)
    callbacks, probes = _callbacks(spec, out_dir)
    _patch_checkpoint_io(spec, probes)
    trainer = _trainer(spec, strategy, callbacks, out_dir)
    model = _module(spec)
    _fit(trainer, model, spec)
    result = _fit_record(trainer, model, probes.recorder) | _probe_record(spec, trainer, model, probes)
    if spec.trainer.evaluate:
        result |= _evaluate(trainer, model, spec)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    _leave_together()


def _report_failure(error: Exception, out_dir: Path, wait_s: float = 20.0) -> None:
    """Write this rank's error, then give the other ranks a moment to write theirs.

    The launcher stops every rank as soon as one exits, so without the wait a rank that is a little
    slower to reach the same error would be killed before it could show that it raises too.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    (out_dir / f"rank{os.environ.get('RANK', '0')}.error").write_text(f"{type(error).__name__}: {error}")
    deadline = time.monotonic() + wait_s
    while len(list(out_dir.glob("rank*.error"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.1)


def run(spec_file: Path, out_dir: Path) -> None:
    """This rank's part of the run ``spec_file`` describes; a failure is reported where the tests read it."""
    spec = RunSpec.from_json(spec_file.read_text())
    with contextlib.ExitStack() as stack:
        if spec.stacks_after_s is not None:  # a hang shows where it waits, even inside a C call
            stacks = stack.enter_context((out_dir / f"rank{os.environ.get('RANK', '0')}.stacks").open("w"))
            faulthandler.dump_traceback_later(spec.stacks_after_s, file=stacks)
            stack.callback(faulthandler.cancel_dump_traceback_later)
        try:
            if spec.model.user_module is not None:
                from tests.support import user_modules

                user_modules.main(spec, out_dir)
            else:
                main(spec, out_dir)
        except Exception as failure:
            _report_failure(failure, out_dir)
            raise


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
