"""Fault tolerance's knobs: which engine runs the replicate dimension (``titan_strategy.fault_tolerance``)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from titan_strategy.knobs import check_choice, check_positive, knob

if TYPE_CHECKING:
    from titan_strategy.config.mesh import MeshConfig

__all__ = ["LIGHTHOUSE_ENV", "REPLICA_GROUP_ENV", "FaultTolerance", "FaultToleranceConfig"]


FaultTolerance = Literal["none", "torchft"]


LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable


REPLICA_GROUP_ENV = "TITAN_REPLICA_GROUP_ID"


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Which fault-tolerance engine runs the replicate dimension, and where its lighthouse is."""

    mode: FaultTolerance = knob("fault_tolerance", "none")
    """"none"; "torchft": each HSDP replica is a torchft replica group that trains on when others die."""
    lighthouse: str | None = knob("torchft_lighthouse", None)
    """The lighthouse's address, e.g. "http://host:29510"; None reads ``TORCHFT_LIGHTHOUSE``."""
    replica_group_id: int | None = knob("replica_group_id", None)
    """This job's replica group, 0 .. data_parallel_replicate_size - 1; None reads ``TITAN_REPLICA_GROUP_ID``."""
    min_replica_groups: int = knob("min_replica_groups", 1)
    """Groups that must be alive for a step to commit."""

    def __post_init__(self) -> None:
        check_choice("fault_tolerance", self.mode, FaultTolerance)
        check_positive("min_replica_groups", self.min_replica_groups)

    @property
    def enabled(self) -> bool:
        return self.mode == "torchft"

    def check_layout(self, mesh: MeshConfig, pipeline_parallel_size: int) -> None:
        """Refuse what torchft replica groups cannot run, naming the fix (called with the other knobs' rules)."""
        if not self.enabled:
            return
        if mesh.dp_replicate < 2:
            raise ValueError(f"fault_tolerance='torchft' runs each of the data_parallel_replicate_size replicas as a "
                             f"replica group, and data_parallel_replicate_size={mesh.dp_replicate} leaves no other "
                             "group to train on when one dies. Set data_parallel_replicate_size to the number of "
                             "replica groups (>= 2), or fault_tolerance='none'.")
        if pipeline_parallel_size > 1:
            raise ValueError(f"fault_tolerance='torchft' with pipeline_parallel_size={pipeline_parallel_size} is not "
                             "built: the pipeline schedule runs forward and backward inside training_step, and a "
                             "step that does not commit would have to run through the schedule again, which is not "
                             "done here. Use pipeline_parallel_size=1, or fault_tolerance='none'.")
        if self.min_replica_groups > mesh.dp_replicate:
            raise ValueError(f"min_replica_groups={self.min_replica_groups} exceeds data_parallel_replicate_size="
                             f"{mesh.dp_replicate}: no step could ever commit. Use at most {mesh.dp_replicate}.")

    def check_job(self, replicas: int) -> None:
        """Refuse a job that does not say where the lighthouse is or which group it is (TitanStrategy's
        constructor: ``titan plan`` reads configs without them)."""
        if not self.enabled:
            return
        if importlib.util.find_spec("torchft") is None:
            raise ImportError("fault_tolerance='torchft' needs torchft: pip install torchft (or the project's "
                              "'ft' extra: pip install -e '.[ft]').")
        self.lighthouse_address()
        self.group_id(replicas)

    def process_mesh(self, mesh: MeshConfig) -> MeshConfig:
        """The degrees of this job's processes: under torchft the replicas are other jobs."""
        return replace(mesh, dp_replicate=1) if self.enabled else mesh

    def lighthouse_address(self) -> str:
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError("fault_tolerance='torchft' needs a lighthouse: pass torchft_lighthouse='http://HOST:PORT' "
                             f"or set {LIGHTHOUSE_ENV}. Start one with `torchft_lighthouse --min_replicas 1 "
                             "--join_timeout_ms 10000 --bind [::]:29510` (it comes with `pip install torchft`).")
        return address

    def group_id(self, replicas: int) -> int:
        group = self.replica_group_id
        if group is None:
            text = os.environ.get(REPLICA_GROUP_ENV)
            if text is None or not text.strip().isdigit():
                raise ValueError(f"fault_tolerance='torchft' needs this job's replica group: pass replica_group_id "
                                 f"or set {REPLICA_GROUP_ENV} (0 .. {replicas - 1}); got {text!r}.")
            group = int(text)
        if not 0 <= group < replicas:
            raise ValueError(f"replica_group_id={group} is outside 0 .. {replicas - 1} "
                             f"(data_parallel_replicate_size={replicas}).")
        return group
