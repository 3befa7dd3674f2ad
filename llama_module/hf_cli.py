"""``titan-hf``: move Llama weights between TitanStrategy checkpoints and Hugging Face ``transformers``.

    titan-hf export CKPT OUT_DIR      # model.safetensors + config.json that LlamaForCausalLM loads
    titan-hf import HF_DIR OUT_CKPT   # weights to start training from: TitanStrategy(initial_weights=OUT_CKPT)

Both run in one process without a process group and read sharded DCP checkpoints of any layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from llama_module.args import LlamaConfig
from llama_module.hf import (
    config_from_hf,
    from_hf_state_dict,
    hf_config,
    to_hf_state_dict,
)
from titan_strategy.checkpoint import (
    read_hyper_parameters,
    read_model_weights,
    write_model_weights,
)

__all__ = ["export_to_hf", "import_from_hf", "main"]

# LlamaModule keeps the Llama as ``self.model``: parameter names in its checkpoints carry this prefix.
_MODULE_PREFIX = "model."
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_to_hf(checkpoint: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Write ``out_dir/model.safetensors`` and ``out_dir/config.json`` from a LlamaModule checkpoint."""
    from safetensors.torch import save_file

    from llama_module.module import LlamaModule

    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory for the export.")
    config = LlamaModule(**read_hyper_parameters(checkpoint)).config
    weights = {name.removeprefix(_MODULE_PREFIX): tensor for name, tensor in read_model_weights(checkpoint).items()}
    hf_weights = {name: tensor.to(_DTYPES[dtype]) for name, tensor in to_hf_state_dict(weights, config).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(hf_weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(config, torch_dtype=dtype), indent=2) + "\n")


def import_from_hf(hf_dir: Path, checkpoint: Path) -> LlamaConfig:
    """Write the weights of an HF Llama directory as a TitanStrategy weights checkpoint (fp32)."""
    from safetensors.torch import load_file

    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json; pass a Hugging Face model directory.")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir} has no *.safetensors weights (PyTorch .bin files are not read: "
                                "unpickling them could run arbitrary code).")
    config = config_from_hf(json.loads(config_file.read_text()))
    hf_weights: dict[str, torch.Tensor] = {}
    for file in files:
        hf_weights |= load_file(str(file))
    weights = {_MODULE_PREFIX + name: tensor.float() for name, tensor in from_hf_state_dict(hf_weights, config).items()}
    write_model_weights(weights, checkpoint, hyper_parameters={"model": dataclasses.asdict(config)})
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="titan-hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="TitanStrategy checkpoint -> Hugging Face directory")
    export.add_argument("checkpoint", type=Path)
    export.add_argument("out_dir", type=Path)
    export.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    imported = commands.add_parser("import", help="Hugging Face directory -> TitanStrategy weights checkpoint")
    imported.add_argument("hf_dir", type=Path)
    imported.add_argument("checkpoint", type=Path)
    args = parser.parse_args(argv)
    if args.command == "export":
        export_to_hf(args.checkpoint, args.out_dir, args.dtype)
        print(f"Wrote {args.out_dir}/model.safetensors and config.json")
    else:
        config = import_from_hf(args.hf_dir, args.checkpoint)
        print(f"Wrote {args.checkpoint} ({config.n_layers} blocks, dim {config.dim}); train from it with "
              f"--trainer.strategy.init_args.initial_weights={args.checkpoint}")


if __name__ == "__main__":
    main()
