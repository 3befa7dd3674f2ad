"""``titan``: LightningCLI over LlamaModule + TextDataModule (``titan fit --config configs/debug.yaml``),
``titan plan`` (the capacity planner, ``llama_module/plan_cli.py``), ``titan rehearse`` (one rank of a
multi-GPU config on this device, ``llama_module/rehearse_cli.py``), ``titan report`` (a picture of a run,
``titan_strategy/report.py``) and ``titan convert`` (a checkpoint folder as one file,
``titan_strategy/checkpoint/convert.py``)."""

from __future__ import annotations

import sys
from typing import Optional

import lightning as L
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import titan_strategy  # noqa: F401 -- registers strategy="titan" and makes its class_path resolvable
from llama_module.data import TextDataModule
from llama_module.module import LlamaModule

__all__ = ["TitanCLI", "main", "titan_cli"]

DESCRIPTION = "Train a Llama under TitanStrategy (LightningCLI over LlamaModule and TextDataModule)."
# `titan --help` lists every tool, not only LightningCLI's subcommands.
OTHER_COMMANDS = """\
More commands:
  titan plan --model 8B --gpus 128       rank layouts by speed and memory; --check CONFIG.yaml: does it fit?
  titan rehearse --config CONFIG.yaml    run one rank of a multi-GPU config on this device: memory, compute
  titan report RUN_DIR                   one PNG of a run from its logs: loss, tokens/s and MFU, memory, saves
  titan convert CKPT_DIR OUT.ckpt        a TitanStrategy checkpoint folder as one .ckpt any Trainer resumes
  titan-hf export|import ...             weights to and from Hugging Face transformers
  titan-fr analyze RUN_DIR               explain a hang from the Flight Recorder dumps under RUN_DIR
Each takes --help."""


class _KeepsLineBreaks(DefaultHelpFormatter):
    """The epilog's table as written: argparse would re-flow it into one paragraph."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


class TitanCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": f"{LlamaModule.__module__}.{LlamaModule.__name__}"}})
        # The model's vocabulary follows the tokenizer unless the YAML sets model.init_args.vocab_size.
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        # typing.Optional, not `str | None`: a runtime value handed to jsonargparse, and the two are different objects.
        parser.add_argument("--plan_check", type=Optional[str], default=None,  # noqa: UP045
                            help="a GPU kind (H100, H200, ...): before anything starts, check that the layout runs "
                                 "and fits there (titan plan --check)")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("plan_check"):
            from llama_module.plan_cli import check_training_config
            from titan_strategy.planner import PlanError, get_gpu

            try:
                plan, _ = check_training_config(config.as_dict(), get_gpu(config.plan_check))
            except PlanError as error:
                raise SystemExit(f"titan fit: --plan_check {config.plan_check}: {error}") from None
            print(f"plan check: fits on {config.plan_check}, {plan.estimate.memory_gib:.1f} GiB per GPU estimated")


def main() -> None:
    if sys.argv[1:2] == ["plan"]:  # `titan plan ...`: the capacity planner, not a LightningCLI subcommand
        from llama_module.plan_cli import main as plan

        raise SystemExit(plan(sys.argv[2:]))
    if sys.argv[1:2] == ["report"]:  # `titan report RUN_DIR`: a PNG of a run from its logs
        from titan_strategy.report import main as report

        raise SystemExit(report(sys.argv[2:]))
    if sys.argv[1:2] == ["convert"]:  # `titan convert CKPT_DIR OUT.ckpt`: one file any Trainer loads
        from titan_strategy.checkpoint.convert import main as convert

        raise SystemExit(convert(sys.argv[2:]))
    if sys.argv[1:2] == ["rehearse"]:  # `titan rehearse ...`: one rank of the config on this device
        from llama_module.rehearse_cli import main as rehearse

        raise SystemExit(rehearse(sys.argv[2:]))
    titan_cli()


def titan_cli(args: list[str] | None = None, cli_class: type[TitanCLI] = TitanCLI) -> TitanCLI:
    """``titan fit|validate|...``: any LightningModule by class_path (``llama_module.CausalLM`` for a transformers
    model), ``LlamaModule`` where the config names none."""
    return cli_class(L.LightningModule, TextDataModule, subclass_mode_model=True, seed_everything_default=0, args=args,
                    parser_kwargs={"description": DESCRIPTION, "epilog": OTHER_COMMANDS,
                                   "formatter_class": _KeepsLineBreaks})


if __name__ == "__main__":
    main()
