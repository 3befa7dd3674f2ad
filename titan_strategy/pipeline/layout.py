"""Pipeline knobs, validated, and the layout they resolve to: stages, their blocks and their ranks.

Pure arithmetic (no process group, no model), so every rule is checked before any model work.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineLayout", "check_microbatch_split"]


@dataclass(frozen=True)
class PipelineLayout:
    """Where every stage's blocks come from and which pipeline rank runs it.

    Attributes:
        blocks: per stage, the range of block indices it holds (stage 0 first).
        ranks: per stage, the pipeline rank (coordinate on the ``pp`` mesh dim) that runs it.
        microbatches: microbatches each Lightning batch is split into.
    """

    blocks: tuple[range, ...]
    ranks: tuple[int, ...]
    microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stage indices run by ``pp_rank``, in increasing order."""
        return [stage for stage, rank in enumerate(self.ranks) if rank == pp_rank]


def check_microbatch_split(batch_size: int, microbatches: int) -> None:
    """A Lightning batch must split into equal microbatches (the loss is a mean of their means)."""
    if batch_size % microbatches:
        raise ValueError(f"A batch of {batch_size} samples cannot be split into "
                         f"pipeline_microbatches={microbatches} equal microbatches; "
                         "use a per-rank batch size divisible by it (and drop_last=True), or change "
                         "pipeline_microbatches.")


