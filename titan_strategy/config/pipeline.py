"""Pipeline knobs, validated, and the layout they resolve to: stages, their blocks and their ranks.

Pure arithmetic (no process group, no model), so every rule is checked before any model work."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from titan_strategy.knobs import check_choice, check_positive, choices, knob
from titan_strategy.pipeline.layout import PipelineLayout

__all__ = ["PIPELINE_SCHEDULES", "ZERO_BUBBLE_SCHEDULES", "PipelineConfig", "ScheduleName"]


ScheduleName = Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                       "DualPipeV"]


PIPELINE_SCHEDULES: tuple[str, ...] = choices(ScheduleName)


SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")


V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


# Schedules that split backward into input- and weight-gradient passes; torch refuses compiled stages for them.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelineConfig:
    """How the pipeline splits the model and schedules its microbatches; ``__post_init__`` checks what needs no
    model. The degree is the mesh's knob."""

    size: int = 1
    """The mesh's ``pipeline_parallel_size`` (``MeshConfig.pp``), which ``TitanConfig.from_knobs`` sets."""
    schedule: ScheduleName = knob("pipeline_schedule", "1F1B")
    """Which pipeline schedule runs the microbatches."""
    microbatches: int | None = knob("pipeline_microbatches", None)
    """Microbatches each Lightning batch is split into; None: one per stage."""
    stages_per_rank: int | None = knob("pipeline_stages_per_rank", None)
    """Virtual stages per pipeline rank; None: 1 for GPipe/1F1B, else 2."""
    layers_per_stage: int | None = knob("pipeline_layers_per_stage", None)
    """Blocks per stage (the first and last stages may take fewer); None splits evenly."""
    split_points: tuple[int, ...] | None = knob("pipeline_split_points", None)
    """An explicit split: the block indices where stages 1, 2, ... begin."""

    def __post_init__(self) -> None:
        if self.split_points is not None and not isinstance(self.split_points, tuple):
            object.__setattr__(self, "split_points", tuple(self.split_points))  # YAML gives a list
        check_choice("pipeline_schedule", self.schedule, ScheduleName)
        check_positive("pipeline_parallel_size", self.size)
        for name, value in (("pipeline_microbatches", self.microbatches),
                            ("pipeline_stages_per_rank", self.stages_per_rank),
                            ("pipeline_layers_per_stage", self.layers_per_stage)):
            check_positive(name, value, optional=True)
        if self.layers_per_stage is not None and self.split_points is not None:
            raise ValueError("Set pipeline_layers_per_stage or pipeline_split_points, not both: each fixes the split.")
        if self.split_points is not None and list(self.split_points) != sorted(set(self.split_points)):
            raise ValueError(f"pipeline_split_points={list(self.split_points)} "
                             "must be strictly increasing block indices.")
        spr = self.stages_per_rank
        if spr is not None and self.schedule in SINGLE_STAGE_SCHEDULES and spr != 1:
            raise ValueError(f"pipeline_schedule={self.schedule!r} runs one stage per rank, but "
                             f"pipeline_stages_per_rank={spr}; use 1, or a multi-stage schedule "
                             "such as 'Interleaved1F1B'.")
        if spr is not None and self.schedule in V_SCHEDULES and spr != 2:
            raise ValueError(f"pipeline_schedule={self.schedule!r} places exactly 2 stages per rank in a V, but "
                             f"pipeline_stages_per_rank={spr}; use 2 (or leave it unset).")

    def check_module(self, module: Any) -> None:
        """Under PP the schedule runs forward and backward: the LightningModule cannot optimize by hand."""
        if self.size > 1 and not module.automatic_optimization:
            raise ValueError(f"pipeline_parallel_size={self.size} runs forward and backward inside the pipeline "
                             "schedule, which needs Lightning's automatic optimization; remove "
                             "`self.automatic_optimization = False` or set pipeline_parallel_size=1.")

    @property
    def is_single_stage(self) -> bool:
        return self.schedule in SINGLE_STAGE_SCHEDULES

    def resolve(self, num_blocks: int) -> PipelineLayout:
        """Split ``num_blocks`` blocks into stages and place the stages on ranks.

        Raises:
            ValueError: the knobs contradict each other or the model (too few blocks, bad split,
                microbatch count the schedule cannot run).
        """
        num_stages = self._num_stages(num_blocks)
        self._check_stage_count(num_stages, num_blocks)
        blocks = self._split(num_blocks, num_stages)
        microbatches = self.microbatches or num_stages
        self._check_microbatches(microbatches, num_stages)
        ranks = tuple(_v_rank(s, self.size) if self.schedule in V_SCHEDULES else s % self.size
                      for s in range(num_stages))
        return PipelineLayout(blocks=blocks, ranks=ranks, microbatches=microbatches)

    def _num_stages(self, num_blocks: int) -> int:
        if self.split_points is not None:
            return len(self.split_points) + 1
        if self.layers_per_stage is not None:
            return math.ceil(num_blocks / self.layers_per_stage)
        return self.size * (self.stages_per_rank or (1 if self.is_single_stage else 2))

    def _check_stage_count(self, num_stages: int, num_blocks: int) -> None:
        source = (f"pipeline_split_points={list(self.split_points)}" if self.split_points is not None else
                  f"pipeline_layers_per_stage={self.layers_per_stage} over {num_blocks} blocks"
                  if self.layers_per_stage is not None else None)
        if num_stages % self.size:
            raise ValueError(f"{source} gives {num_stages} stages, which pipeline_parallel_size={self.size} ranks "
                             "cannot share evenly; "
                             "choose a split whose stage count is a multiple of the pipeline size.")
        per_rank = num_stages // self.size
        if self.stages_per_rank is not None and per_rank != self.stages_per_rank:
            raise ValueError(f"{source} gives {per_rank} stages per rank, but pipeline_stages_per_rank="
                             f"{self.stages_per_rank}; drop one of the two knobs.")
        if self.is_single_stage and per_rank != 1:
            raise ValueError(f"{source} gives {per_rank} stages per rank, but pipeline_schedule={self.schedule!r} "
                             "runs one; use a multi-stage schedule such as 'Interleaved1F1B', "
                             "or a split with one stage per rank.")
        if self.schedule in V_SCHEDULES and per_rank != 2:
            raise ValueError(f"{source} gives {per_rank} stages per rank, but pipeline_schedule={self.schedule!r} "
                             "needs exactly 2; choose a split with 2 x pipeline_parallel_size stages.")
        if num_blocks < num_stages:
            raise ValueError(f"The model has {num_blocks} blocks, fewer than the {num_stages} pipeline stages "
                             f"(pipeline_parallel_size={self.size} x {per_rank} per rank); "
                             "every stage needs at least one. "
                             "Lower pipeline_parallel_size or pipeline_stages_per_rank.")

    def _split(self, num_blocks: int, num_stages: int) -> tuple[range, ...]:
        if self.split_points is not None:
            points = list(self.split_points)
            if points[0] <= 0 or points[-1] >= num_blocks:
                raise ValueError(f"pipeline_split_points={points} must lie strictly between 0 and the model's "
                                 f"{num_blocks} blocks, so that no stage is empty.")
            sizes = [b - a for a, b in zip([0, *points], [*points, num_blocks])]
        elif self.layers_per_stage is not None:
            sizes = _sizes_per_stage(num_blocks, num_stages, self.layers_per_stage)
        else:
            sizes = _even_sizes(num_blocks, num_stages)
        starts = [sum(sizes[:i]) for i in range(num_stages)]
        return tuple(range(start, start + size) for start, size in zip(starts, sizes))

    def _check_microbatches(self, microbatches: int, num_stages: int) -> None:
        # The same rules torch's schedules enforce, raised here with the knobs to change.
        needed = {"1F1B": self.size, "DualPipeV": num_stages}.get(self.schedule)
        if needed is not None and microbatches < needed:
            raise ValueError(f"pipeline_schedule={self.schedule!r} needs at least {needed} microbatches "
                             f"(one per stage), but pipeline_microbatches={microbatches}; "
                             f"raise it to {needed} or more.")
        if self.schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
            rounds = max(1, microbatches // self.size)
            if microbatches % rounds:
                raise ValueError(f"pipeline_schedule={self.schedule!r} runs microbatches in rounds of "
                                 f"pipeline_parallel_size={self.size}; pipeline_microbatches={microbatches} is not a "
                                 f"multiple of its {rounds} rounds. Use a multiple of {self.size}.")


def _even_sizes(num_blocks: int, num_stages: int) -> list[int]:
    """Equal shares; the remainder goes to the middle stages first, since the first and last stages
    also carry the embedding and the output projection."""
    sizes = [num_blocks // num_stages] * num_stages
    order = [*range(1, num_stages - 1), 0, num_stages - 1]
    for stage in order[: num_blocks % num_stages]:
        sizes[stage] += 1
    return sizes


def _sizes_per_stage(num_blocks: int, num_stages: int, per_stage: int) -> list[int]:
    """``per_stage`` blocks each; the shortfall is taken from the last stage (output + loss) and the first."""
    sizes = [per_stage] * num_stages
    shortfall = num_stages * per_stage - num_blocks
    sizes[-1] -= math.ceil(shortfall / 2)
    sizes[0] -= shortfall // 2
    return sizes


def _v_rank(stage: int, size: int) -> int:
    """V placement: stages 0..size-1 go down the ranks, size..2*size-1 come back up."""
    return stage % size if (stage // size) % 2 == 0 else size - 1 - stage % size
