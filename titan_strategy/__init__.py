"""TitanStrategy: 4-D parallel LLM pre-training (FSDP2/HSDP, TP, CP, PP) as a Lightning Strategy.

Importing this package registers the strategy name ``"titan"``: ``Trainer(strategy="titan")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from titan_strategy.callbacks import FlightRecorder, Throughput
from titan_strategy.checkpoint import (
    CHECKPOINT_MODES,
    ELASTIC_POSITION_KEY,
    CorruptCheckpointError,
    DistributedCheckpointIO,
)
from titan_strategy.mesh import ParallelDims, TitanMesh
from titan_strategy.pipeline.layout import PIPELINE_SCHEDULES
from titan_strategy.plan import ContextParallelPlan, ParallelPlan, PipelinePlan, TensorParallelPlan
from titan_strategy.step_metrics import log_step_metric
from titan_strategy.strategy import TitanStrategy

__all__ = ["CHECKPOINT_MODES", "ELASTIC_POSITION_KEY", "PIPELINE_SCHEDULES", "ContextParallelPlan",
           "CorruptCheckpointError", "DistributedCheckpointIO", "FlightRecorder", "ParallelDims", "ParallelPlan",
           "PipelinePlan", "TensorParallelPlan", "Throughput", "TitanMesh", "TitanStrategy", "log_step_metric"]

if TitanStrategy.strategy_name not in StrategyRegistry:
    TitanStrategy.register_strategies(StrategyRegistry)
