"""``titan``: LightningCLI over LlamaModule + TextDataModule (``titan fit --config configs/debug.yaml``), and
``titan plan`` (the capacity planner, ``llama_module/plan_cli.py``)."""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import titan_strategy  # noqa: F401 -- registers strategy="titan" and makes its class_path resolvable
from llama_module.data import TextDataModule
from llama_module.module import LlamaModule

__all__ = ["TitanCLI", "main"]


class TitanCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The model's vocabulary follows the tokenizer unless the YAML sets model.vocab_size.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main() -> None:
    if sys.argv[1:2] == ["plan"]:  # `titan plan ...`: the capacity planner, not a LightningCLI subcommand
        from llama_module.plan_cli import main as plan

        raise SystemExit(plan(sys.argv[2:]))
    TitanCLI(LlamaModule, TextDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
