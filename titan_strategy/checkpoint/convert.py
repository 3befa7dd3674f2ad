"""``titan convert CKPT_DIR OUT.ckpt``: a TitanStrategy checkpoint folder as one Lightning ``.ckpt`` file, which any
Trainer (DDP, one device) resumes from and ``LightningModule.load_from_checkpoint`` reads. One process, no GPU."""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_strategy.checkpoint.dcp import LAYOUT_KEY, LIGHTNING_STATE_FILE, is_titan_checkpoint
from titan_strategy.checkpoint.io import partial_path

__all__ = ["consolidate", "main"]


def _split_key(key: str) -> tuple[str, str, str]:
    """``"state.layers.0.w.exp_avg"`` -> ``("state", "layers.0.w", "exp_avg")``: the entry's last dotted part is
    the state or hyper-parameter name, which has no dot."""
    section, _, rest = key.partition(".")
    fqn, _, name = rest.rpartition(".")
    return section, fqn, name


def _indexed_optimizer_state(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened, name-keyed optimizer state (``flatten_optimizer_state_dict``) as ``Optimizer.state_dict()`` has
    it: parameters numbered in saved order, and a parameter group for each run of parameters saved next to each
    other with the same hyper-parameters (adjacent groups that differ in none merge: a Trainer whose optimizer
    has more groups then refuses the file)."""
    hyper: dict[str, dict[str, Any]] = {}
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, fqn, name = _split_key(key)
        (hyper if section == "param_groups" else state).setdefault(fqn, {})[name] = value
    index = {fqn: number for number, fqn in enumerate(hyper)}
    groups: list[dict[str, Any]] = []
    for fqn, values in hyper.items():
        if groups and {k: v for k, v in groups[-1].items() if k != "params"} == values:
            groups[-1]["params"].append(index[fqn])
        else:
            groups.append({**values, "params": [index[fqn]]})
    return {"state": {index[fqn]: values for fqn, values in state.items()}, "param_groups": groups}


def consolidate(path: Path) -> dict[str, Any]:
    """The whole Lightning checkpoint dict of a TitanStrategy checkpoint folder (weights and optimizer states
    whole, on the CPU). Per-rank dataloader positions and RNG states stay behind, as a single-file save has none.

    Raises:
        FileNotFoundError: ``path`` is not a complete TitanStrategy checkpoint.
    """
    if not is_titan_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete TitanStrategy checkpoint folder; titan convert reads "
                                "what Trainer.save_checkpoint or ModelCheckpoint wrote under TitanStrategy.")
    checkpoint = torch.load(path / LIGHTNING_STATE_FILE, map_location="cpu", weights_only=True)
    checkpoint.pop(LAYOUT_KEY, None)
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
        dcp_to_torch_save(path, Path(scratch) / "whole.pt")
        saved = torch.load(Path(scratch) / "whole.pt", map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = saved["model"]
    count = sum(1 for key in saved if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [_indexed_optimizer_state(saved[f"optimizer_{index}"]) for index in range(count)]
    return checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titan convert", description="Write a TitanStrategy checkpoint folder as "
                                     "one Lightning .ckpt file that any Trainer resumes from.")
    parser.add_argument("checkpoint", type=Path, help="a TitanStrategy checkpoint folder")
    parser.add_argument("output", type=Path, help="the .ckpt file to write")
    args = parser.parse_args(argv)
    if args.output.exists():
        parser.error(f"{args.output} exists; choose a new file name.")
    try:
        checkpoint = consolidate(args.checkpoint)
    except FileNotFoundError as error:
        parser.error(str(error))
    partial = partial_path(args.output)  # nothing half-written under the final name
    torch.save(checkpoint, partial)
    partial.rename(args.output)
    print(f"wrote {args.output}: global step {checkpoint.get('global_step')}, {len(checkpoint['state_dict'])} "
          f"model tensors, {len(checkpoint['optimizer_states'])} optimizer states")
    return 0
