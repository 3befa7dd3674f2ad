"""TitanStrategy: 4-D parallel LLM pre-training (FSDP2/HSDP, TP, CP, PP) as a Lightning Strategy.

Importing this package registers the strategy name ``"titan"``: ``Trainer(strategy="titan")``. Its ``__all__``,
with the ``kernels`` and ``callbacks`` subpackages, is the public API: what a LightningModule or a training script
needs (the docs and ``llama_module``'s model and module use these; its command-line tools reach further in).
"""

from lightning.pytorch.strategies import StrategyRegistry

from titan_strategy.callbacks import FlightRecorder, Throughput
from titan_strategy.checkpoint import ELASTIC_POSITION_KEY, CorruptCheckpointError, DistributedCheckpointIO
from titan_strategy.config import TitanConfig
from titan_strategy.config.checkpoint import CHECKPOINT_MODES
from titan_strategy.config.mesh import ParallelDims
from titan_strategy.config.pipeline import PIPELINE_SCHEDULES
from titan_strategy.distributed import simulating_ranks
from titan_strategy.knobs import check_choice, choices
from titan_strategy.mesh import TitanMesh
from titan_strategy.parallelize.hf_causal_lm import pretrained_on_meta
from titan_strategy.parallelize.tensor_parallel import VocabularyParallelOutput
from titan_strategy.plan import ContextParallelPlan, ParallelPlan, PipelinePlan, PlannedModule, TensorParallelPlan
from titan_strategy.step_metrics import log_step_metric
from titan_strategy.strategy import TitanStrategy
from titan_strategy.token_loss import (
    IGNORE_INDEX,
    TokenLoss,
    count_labelled,
    is_token_weighted,
    token_cross_entropy,
    token_mean,
)

__all__ = ["CHECKPOINT_MODES", "ELASTIC_POSITION_KEY", "IGNORE_INDEX", "PIPELINE_SCHEDULES", "ContextParallelPlan",
           "CorruptCheckpointError", "DistributedCheckpointIO", "FlightRecorder", "ParallelDims", "ParallelPlan",
           "PipelinePlan", "PlannedModule", "TensorParallelPlan", "Throughput", "TitanConfig", "TitanMesh",
           "TitanStrategy", "TokenLoss", "VocabularyParallelOutput", "check_choice", "choices", "count_labelled",
           "is_token_weighted", "log_step_metric", "pretrained_on_meta", "simulating_ranks", "token_cross_entropy",
           "token_mean"]

if TitanStrategy.strategy_name not in StrategyRegistry:
    TitanStrategy.register_strategies(StrategyRegistry)
