"""The strategy's training sampler on its own: the global order is the same whatever the data-parallel degree, and
a loader whose position cannot be re-derived refuses a resume on another degree."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from titan_strategy.sampler import ResumableSampler, TrainingPosition

pytestmark = pytest.mark.unit


def _global_batches(degree: int, batch_size: int, epoch: int, samples: int) -> list[list[int]]:
    """The epoch's global batches, from ``samples`` on, as ``degree`` ranks of ``batch_size`` draw them."""
    ranks = [list(ResumableSampler(range(24), num_replicas=degree, rank=rank, shuffle=True, seed=7,
                                   position=lambda: (epoch, samples))) for rank in range(degree)]
    per_batch = [[rank[i : i + batch_size] for i in range(0, len(rank), batch_size)] for rank in ranks]
    return [sorted(i for rank in batch for i in rank) for batch in zip(*per_batch)]


def test_global_batches_are_the_same_samples_on_any_degree_and_from_any_position() -> None:
    dp2, dp4 = _global_batches(2, 4, epoch=1, samples=0), _global_batches(4, 2, epoch=1, samples=0)
    assert dp2 == dp4 and len(dp2) == 3
    assert sorted(i for batch in dp2 for i in batch) == list(range(24))
    assert _global_batches(4, 2, epoch=1, samples=8) == dp2[1:]  # resumed after one global batch
    assert _global_batches(2, 4, epoch=2, samples=0) != dp2  # each epoch has its own permutation
    plain = DistributedSampler(range(24), num_replicas=2, rank=0, shuffle=True, seed=7)
    plain.set_epoch(1)
    assert list(plain) == list(ResumableSampler(range(24), num_replicas=2, rank=0, shuffle=True, seed=7,
                                                position=lambda: (1, 0)))


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from range(4)


class _StatefulStream(_Stream):
    def state_dict(self) -> dict[str, int]:
        return {}


def _resume(dataloader: DataLoader, saved_degree: int, degree: int) -> object:
    position = TrainingPosition()
    position.load({TrainingPosition.CHECKPOINT_KEY: {"data_parallel": saved_degree, "sampler": None}})
    return position.process(dataloader, training=True, data_parallel=degree)


def test_a_loader_without_a_position_refuses_another_degree_and_names_both() -> None:
    stream = DataLoader(_Stream(), batch_size=2)
    with pytest.raises(ValueError, match="saved with 2 data-parallel ranks and this run has 4, but the training "
                                         r"loader \(DataLoader\) keeps no position"):
        _resume(stream, saved_degree=2, degree=4)
    assert _resume(stream, saved_degree=2, degree=2) is stream  # the same degree resumes as Lightning defines
    stateful = DataLoader(_StatefulStream(), batch_size=2)
    assert _resume(stateful, saved_degree=2, degree=4) is stateful  # its own state_dict is its position


def _trained_epochs(drop_last: bool) -> list[tuple[int, int]]:
    """The position after each of 8 batches of 30 samples on rank 0 of 2, 4 per rank."""
    sampler = DistributedSampler(range(30), num_replicas=2, rank=0, shuffle=True, seed=7)
    position = TrainingPosition()
    position.process(DataLoader(range(30), batch_size=4, sampler=sampler, drop_last=drop_last), training=True,
                     data_parallel=2)
    positions = []
    for _ in range(8):
        position.batch_started()
        positions.append(position.current())
    return positions


def test_an_epoch_ends_after_its_last_batch_with_or_without_drop_last() -> None:
    # 15 samples per rank: 4 batches (the last of 3), or 3 with drop_last.
    assert _trained_epochs(drop_last=False)[:5] == [(0, 8), (0, 16), (0, 24), (1, 0), (1, 8)]
    assert _trained_epochs(drop_last=True)[:4] == [(0, 8), (0, 16), (1, 0), (1, 8)]
