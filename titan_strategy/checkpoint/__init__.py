"""Checkpoint IO for TitanStrategy."""

from titan_strategy.checkpoint.dcp import is_titan_checkpoint, load_checkpoint, optimizer_state_dict, save_checkpoint

__all__ = ["is_titan_checkpoint", "load_checkpoint", "optimizer_state_dict", "save_checkpoint"]
