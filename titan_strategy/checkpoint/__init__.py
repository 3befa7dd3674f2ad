"""Checkpoint IO for TitanStrategy: full Lightning checkpoints (``dcp``) and model weights alone (``weights``)."""

from titan_strategy.checkpoint.dcp import is_titan_checkpoint, load_checkpoint, optimizer_state_dict, save_checkpoint
from titan_strategy.checkpoint.weights import (
    check_weights_source,
    load_model_weights,
    read_hyper_parameters,
    read_model_weights,
    write_model_weights,
)

__all__ = ["check_weights_source", "is_titan_checkpoint", "load_checkpoint", "load_model_weights",
           "optimizer_state_dict", "read_hyper_parameters", "read_model_weights", "save_checkpoint",
           "write_model_weights"]
