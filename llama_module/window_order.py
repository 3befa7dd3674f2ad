"""The global order of packed training windows: the same under every data-parallel layout, and resumable under any.

The documents are dealt to ``lanes`` streams: lane ``j`` packs the documents ``split_dataset_by_node`` gives rank
``j`` of ``lanes``. Global window ``w`` is window ``w // lanes`` of lane ``w % lanes``, so the order depends on the
lane count alone. A global batch of ``G`` windows starting at window ``W`` holds windows ``W .. W + G - 1``;
data-parallel rank ``r`` trains on its ``B = G / dp`` consecutive ones from ``W + r * B``.

The first run fixes the lane count at its global batch, so each rank reads its own ``B`` lanes and nothing else. A
checkpoint keeps the next window ``W`` and every lane's stream position; a resumed run continues at window ``W`` under
any ``dp``, ``B`` or ``G``. (With another global batch a rank may share lanes with others: it reads and skips
their windows.)
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset

from titan_strategy import ELASTIC_POSITION_KEY

if TYPE_CHECKING:
    from llama_module.packed_windows import PackedWindows

__all__ = ["GlobalWindows", "ResumableLoader"]

LaneWindows = Callable[[int, int], "PackedWindows"]  # (lane, lanes) -> that lane's windows, from its first one


class _Lane:
    """One lane's windows, and how many of them the run has taken."""

    def __init__(self, windows: PackedWindows, taken: int) -> None:
        self.windows = windows
        self.taken = taken
        self._iterator = iter(windows)

    def window(self, index: int) -> dict[str, torch.Tensor]:
        """The lane's window ``index`` (not taken yet); the windows before it, other ranks' share, are skipped."""
        assert index >= self.taken, f"window {index} of a lane already {self.taken} windows in"
        while True:
            window = next(self._iterator)
            self.taken += 1
            if self.taken > index:
                return window

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken, "windows": self.windows.state_dict()}


class GlobalWindows(IterableDataset):
    """This data-parallel rank's share of the global window order, as batches (see the module docstring).

    Yields ``{"input_ids", "labels", "document_ids": [B, seq_len], "window_id": [B]}``; ``window_id`` is each window's
    index in the global order.

    Args:
        lane_windows: builds a lane's windows.
        seq_len: tokens per window's inputs.
        batch_size: windows per batch on this rank (``B``).
        rank, ranks: this rank among the data-parallel ranks, and their number.
    """

    def __init__(self, lane_windows: LaneWindows, seq_len: int, batch_size: int, rank: int, ranks: int) -> None:
        self.lane_windows = lane_windows
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.ranks = ranks
        self.lanes = self.global_batch  # unless a checkpoint says otherwise
        self._next = 0  # the global index of the next batch's first window
        self._lanes: dict[int, _Lane] = {}
        self._saved_lanes: dict[int, dict[str, Any]] = {}  # lane states from the checkpoint, for lanes not read yet

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.ranks

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            first = self._next + self.rank * self.batch_size
            ids = range(first, first + self.batch_size)
            windows = [self._lane(w % self.lanes).window(w // self.lanes) for w in ids]
            self._next += self.global_batch  # before the yield: a state taken after this batch starts past it
            stacked = {key: torch.stack([window[key] for window in windows]) for key in windows[0]}
            yield {**stacked, "window_id": torch.tensor(ids)}

    def _lane(self, lane: int) -> _Lane:
        if lane not in self._lanes:
            windows = self.lane_windows(lane, self.lanes)
            saved = self._saved_lanes.pop(lane, None)
            if saved is not None:
                windows.load_state_dict(saved["windows"])
            self._lanes[lane] = _Lane(windows, saved["taken"] if saved is not None else 0)
        return self._lanes[lane]

    def state_dict(self) -> dict[str, Any]:
        """Global: the next window, and the position of every lane this rank has read or was handed."""
        lanes = {**self._saved_lanes, **{lane: reader.state_dict() for lane, reader in self._lanes.items()}}
        return {ELASTIC_POSITION_KEY: True, "next_window": self._next, "lanes": self.lanes, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "lane_states": lanes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the position from one saved rank's state, or from every saved rank's (``saved_ranks``, as
        TitanStrategy hands them over): each lane continues from the rank that read it furthest."""
        saved = state.get("saved_ranks", [state])
        first = saved[0]
        if first["seq_len"] != self.seq_len:
            raise ValueError(f"The checkpoint's training windows hold seq_len={first['seq_len']} tokens, this run's "
                             f"{self.seq_len}: its position counts windows of the old length. Resume with "
                             f"data.seq_len={first['seq_len']}, or start a new run.")
        if any((s["next_window"], s["lanes"]) != (first["next_window"], first["lanes"]) for s in saved):
            raise ValueError("The checkpoint's data-parallel ranks saved different window positions "
                             f"{sorted({(s['next_window'], s['lanes']) for s in saved})}: it is not one run's.")
        lanes: dict[int, dict[str, Any]] = {}
        for rank_state in saved:
            for lane, lane_state in rank_state["lane_states"].items():
                if lane not in lanes or lane_state["taken"] > lanes[lane]["taken"]:
                    lanes[lane] = lane_state
        self._next, self.lanes, self._saved_lanes, self._lanes = first["next_window"], first["lanes"], lanes, {}
        if first["global_batch"] != self.global_batch:
            tokens = self._next * (self.seq_len + 1)
            rank_zero_info(f"Resuming the training windows at window {self._next} (token {tokens} of the order) "
                           f"with a global batch of {self.global_batch} windows ({self.ranks} ranks x "
                           f"{self.batch_size}); the checkpoint's was {first['global_batch']}. The order stays that "
                           f"of {self.lanes} lanes, so ranks may read and skip windows of lanes they share.")


class ResumableLoader(DataLoader):
    """A single-process DataLoader over ``GlobalWindows`` whose position Lightning saves and restores."""

    def __init__(self, dataset: GlobalWindows) -> None:
        super().__init__(dataset, batch_size=None, num_workers=0)
        self._positions: collections.deque[dict[str, Any]] = collections.deque([dataset.state_dict()], maxlen=2)

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            self._positions.append(self.dataset.state_dict())
            yield batch

    def state_dict(self) -> dict[str, Any]:
        # Lightning's loop fetches one batch ahead of the one it trains on, so the trained-on
        # position is the one before the newest batch.
        return self._positions[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._positions = collections.deque([self.dataset.state_dict()], maxlen=2)
