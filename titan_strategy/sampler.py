"""The training sampler of a map-style DataLoader, owned by the strategy so that a checkpoint resumes it exactly.

Lightning gives every data-parallel rank a ``DistributedSampler``: the epoch's permutation of the dataset
(seeded by ``seed + epoch``), rank ``r`` taking every ``dp``-th index from ``r``. Global batch ``k`` is then
samples ``k * G`` to ``(k + 1) * G - 1`` of the permutation (``G`` = the global batch), whatever ``dp`` is. Two
things break an exact resume: Lightning restarts an interrupted epoch from its first sample, and it sets the
sampler's epoch after the resumed epoch's first batch is drawn (Lightning #21938). ``ResumableSampler`` draws
the same order and takes its position (epoch, and how many samples of the epoch the run has trained on) from
the checkpoint, so the resumed run sees the samples the uninterrupted one would have, in order, and on
another number of data-parallel ranks too (the position is global).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from titan_strategy.run_state import RunState

if TYPE_CHECKING:
    from titan_strategy.checkpoint.dcp import LoadedCheckpoint

__all__ = ["SamplerPosition", "ResumableSampler", "TrainingPosition", "resumable_loader"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerPosition:
    """Where a run stands in its training data: global, so it resumes under any data-parallel degree.

    Attributes:
        epoch: the epoch whose permutation is being drawn.
        samples: samples of that epoch the run has trained on (all ranks together).
        seed: the permutation's seed.
        global_batch: samples per training batch, all ranks together, when the position was saved.
    """

    epoch: int
    samples: int
    seed: int
    global_batch: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler``'s order, drawn from where the run stands: each iterator starts at ``position()``.

    Lightning's loop creates iterators at moments that do not match the data's position after a resume (it
    restarts an interrupted epoch, and an epoch-end checkpoint resumes as one more batch of the finished epoch), so
    the epoch and the first sample come from the run's own count of trained samples, never from ``set_epoch``.
    """

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = position

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch is the run's position (see the class docstring)."""

    def __iter__(self) -> Iterator[int]:
        self.epoch, start = self._position()
        order = self._global_order()
        remaining = order[start:]
        # Every rank must draw as many samples as the others (they step together): the tail is padded from the
        # epoch's start, as DistributedSampler pads a dataset that does not divide.
        short = -len(remaining) % self.num_replicas
        remaining += order[:short]
        return iter(remaining[self.rank :: self.num_replicas])

    def _global_order(self) -> list[int]:
        """The epoch's indices for every rank together, interleaved as DistributedSampler deals them out."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        if self.drop_last:
            return order[: self.total_size]
        return (order * math.ceil(self.total_size / len(order)))[: self.total_size]


def resumable_loader(dataloader: DataLoader, position: Callable[[], tuple[int, int]]) -> DataLoader | None:
    """The same loader drawing through a ``ResumableSampler``, where Lightning injected a plain DistributedSampler
    (over a RandomSampler or SequentialSampler); None for any other loader, which keeps its own semantics."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    sampler = getattr(dataloader, "sampler", None)
    if type(sampler) is not DistributedSampler or getattr(dataloader, "batch_size", None) is None:
        return None
    resumable = ResumableSampler(sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank,
                                 shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last,
                                 position=position)
    return _update_dataloader(dataloader, resumable, mode=RunningStage.TRAINING)


class TrainingPosition(RunState):
    """The strategy's side of the training sampler: it counts the samples the run trains on, draws each new
    iterator from there, saves the position in every checkpoint and takes it back from the one a run resumes.

    Every checkpoint also records the data-parallel degree, so that a resume on another degree with a loader whose
    position cannot be re-derived (the user's iterable loader without ``state_dict``) fails before training.
    """

    CHECKPOINT_KEY = "titan_data"

    def __init__(self) -> None:
        self._sampler: ResumableSampler | None = None
        self._batch_size = 0
        self._data_parallel = 1
        self._epoch_samples = 0
        self._epoch = 0
        self._samples = 0  # of ``_epoch``, trained on by every rank together
        self._loaded: dict[str, Any] | None = None
        self._loops_position: tuple[int, int] | None = None  # (epoch, batches of it) of another strategy's save

    @property
    def _global_batch(self) -> int:
        return self._batch_size * self._data_parallel

    def process(self, dataloader: object, training: bool, data_parallel: int) -> object:
        """``Strategy.process_dataloader``: the training loader draws through a ``ResumableSampler``."""
        if not training:
            return dataloader
        self._data_parallel = data_parallel
        resumable = resumable_loader(dataloader, self.current) if isinstance(dataloader, DataLoader) else None
        loaded, self._loaded = self._loaded, None
        if resumable is None:
            if loaded is not None:
                _check_position_kept(dataloader, loaded["data_parallel"], data_parallel)
            return dataloader
        self._sampler, self._batch_size = resumable.sampler, resumable.batch_size
        # The samples an epoch trains on, all ranks together: a loader with drop_last leaves each rank's tail out.
        batches = len(self._sampler) // self._batch_size if resumable.drop_last else len(resumable)
        self._epoch_samples = batches * self._global_batch
        if loaded is not None and loaded["sampler"] is not None:
            self._resume(SamplerPosition(**loaded["sampler"]))
        elif self._loops_position is not None:  # the saving run's global batch is taken to be this run's
            epoch, batches = self._loops_position
            self._epoch, self._samples = epoch, batches * self._global_batch
        self._loops_position = None
        return resumable

    @override
    def batch_started(self) -> None:
        """A training batch is about to be trained on: the next one comes after it."""
        if self._sampler is None:
            return
        self._samples += self._global_batch
        if self._samples >= self._epoch_samples:
            self._epoch, self._samples = self._epoch + 1, 0

    @override
    def save(self, checkpoint: dict[str, Any]) -> None:
        """Add the data-parallel degree and the sampler's position to Lightning's checkpoint dict."""
        position = None
        if self._sampler is not None:
            position = SamplerPosition(self._epoch, self._samples, self._sampler.seed, self._global_batch).to_dict()
        checkpoint[self.CHECKPOINT_KEY] = {"data_parallel": self._data_parallel, "sampler": position}

    @override
    def load(self, checkpoint: dict[str, Any], sharded: LoadedCheckpoint | None = None) -> None:
        """Keep the loaded checkpoint's position for the training loader Lightning builds next. A checkpoint of
        another strategy (DDP's) has none of ours: its loops say how many batches of which epoch were trained."""
        self._loaded = checkpoint.get(self.CHECKPOINT_KEY)
        self._loops_position = None if self._loaded is not None else _batches_trained(checkpoint)

    def current(self) -> tuple[int, int]:
        """(epoch, samples of it trained on by all ranks): where the next training iterator starts."""
        return self._epoch, self._samples

    def _resume(self, position: SamplerPosition) -> None:
        sampler = self._sampler
        assert sampler is not None
        global_batch = self._global_batch
        if position.samples % global_batch:
            raise ValueError(f"The checkpoint stopped after {position.samples} samples of epoch {position.epoch}, "
                             f"not a whole number of this run's global batches of {global_batch} samples "
                             f"({sampler.num_replicas} ranks x {self._batch_size}; the checkpoint's was "
                             f"{position.global_batch}). Choose a per-rank batch size whose global batch divides "
                             f"{position.samples}, or resume from a checkpoint saved at an epoch's end.")
        if position.seed != sampler.seed:
            raise ValueError(f"The checkpoint's training order was seeded with {position.seed}, this run's sampler "
                             f"with {sampler.seed}; resume with the same seed (seed_everything({position.seed})).")
        if global_batch != position.global_batch:
            log.warning("Resuming at sample %d of epoch %d with a global batch of %d samples (%d ranks x %d); the "
                        "checkpoint's was %d: the run continues from the same sample, in the same order.",
                        position.samples, position.epoch, global_batch, sampler.num_replicas, self._batch_size,
                        position.global_batch)
        self._epoch, self._samples = position.epoch, position.samples


def _batches_trained(checkpoint: dict[str, Any]) -> tuple[int, int] | None:
    """(epoch, batches of it trained on) by Lightning's fit loop state in ``checkpoint``; None without one."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if progress is None:
        return None
    epoch, batches = checkpoint.get("epoch", 0), progress["current"]["processed"]
    return (epoch + 1, 0) if progress.get("is_last_batch") else (epoch, batches)


def _check_position_kept(dataloader: object, saved_degree: int, degree: int) -> None:
    """A loader the strategy does not position resumes on another data-parallel degree only if it keeps its own
    position (``state_dict``/``load_state_dict``, as Lightning defines for stateful loaders)."""
    keeps_position = any(callable(getattr(holder, "state_dict", None))
                         for holder in (dataloader, getattr(dataloader, "dataset", None)))
    if saved_degree != degree and not keeps_position:
        raise ValueError(f"The checkpoint was saved with {saved_degree} data-parallel ranks and this run has {degree}, "
                         f"but the training loader ({type(dataloader).__name__}) keeps no position that could be "
                         f"re-derived for another degree. Resume on {saved_degree} data-parallel ranks, use a "
                         "map-style Dataset (the strategy then positions its sampler), or give the loader "
                         "state_dict()/load_state_dict() that hold a global position.")
