"""Checkpoints for TitanStrategy: what they hold (``dcp``), how they are written (``io``), when they count as
complete (``manifest``), per-rank RNG states (``rng``) and model weights alone (``weights``)."""

from titan_strategy.checkpoint.dcp import (
    ELASTIC_POSITION_KEY,
    RankPlace,
    is_titan_checkpoint,
    load_checkpoint,
    newest_complete_checkpoint,
    optimizer_state_dict,
)
from titan_strategy.checkpoint.io import CheckpointDiskFullError, DistributedCheckpointIO, SaveTiming
from titan_strategy.checkpoint.manifest import CorruptCheckpointError
from titan_strategy.checkpoint.rng import restore_rng_states
from titan_strategy.checkpoint.weights import (
    check_weights_source,
    load_model_weights,
    read_hyper_parameters,
    read_model_weights,
    write_model_weights,
)

__all__ = ["ELASTIC_POSITION_KEY", "CheckpointDiskFullError", "CorruptCheckpointError",
           "DistributedCheckpointIO", "RankPlace", "SaveTiming", "check_weights_source", "is_titan_checkpoint",
           "load_checkpoint", "load_model_weights", "newest_complete_checkpoint", "optimizer_state_dict",
           "read_hyper_parameters", "read_model_weights", "restore_rng_states", "write_model_weights"]
