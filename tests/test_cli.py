"""`titan fit --config configs/debug.yaml` end to end, through Lightning's own process launcher."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from llama_module import LlamaModule
from tests.conftest import REPO, run_command
from titan_strategy.report import read_scalars

# The same config as a 2-stage pipeline: a V-schedule puts 2 of the 4 blocks' stages on each process.
PIPELINE = ["--trainer.strategy.init_args.pipeline_parallel_size=2",
            "--trainer.strategy.init_args.pipeline_schedule=ZBVZeroBubble"]


@pytest.mark.multiprocess  # `titan fit` in a subprocess, which starts its ranks
@pytest.mark.parametrize("overrides", [[], PIPELINE], ids=["fsdp2", "pp2-zbv"])
def test_debug_config_trains_validates_and_checkpoints(overrides: list[str], tmp_path: Path,
                                                       test_env: dict[str, str]) -> None:
    # The installed console script; from a plain checkout (no pip install), the same entry point.
    titan = shutil.which("titan")
    command = [titan] if titan else [sys.executable, "-m", "llama_module.cli"]
    fit = run_command([*command, "fit", "--config", str(REPO / "configs" / "debug.yaml"), "--trainer.max_steps=6",
                       "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
                       "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}",
                       "--trainer.enable_progress_bar=false", *overrides], test_env, tmp_path)
    output = fit.stdout + fit.stderr
    # The summary's FLOPs are the module's (Lightning's own count says 0), each save says one line, and the
    # epoch-level val loss raises no sync_dist warning.
    flops = LlamaModule(model="debug", vocab_size=8448).flops_per_token(128) * 128
    assert f"Total FLOPs {get_human_readable_count(flops)}: training one 128-token sequence" in output
    assert "Total FLOPs: 0" not in output and "sync_dist=True" not in output
    assert re.search(r"Checkpoint of step 6 published: \S+\.ckpt, [0-9.]+ GiB, [0-9.]+ s until published", output)
    [run_dir] = (tmp_path / "lightning_logs").iterdir()
    scalars, log = read_scalars(tmp_path)  # the config's TensorBoard logger
    assert log.parent == run_dir and len(scalars["train_loss"]) == 6 and len(scalars["val_loss"]) == 2
    assert {"grad_norm", "lr-AdamW"} <= set(scalars)  # (Throughput's 10-step windows: none in 6 steps)
    report = run_command([*command, "report", str(tmp_path), "--png", str(tmp_path / "run.png")], test_env, tmp_path)
    assert (tmp_path / "run.png").read_bytes().startswith(b"\x89PNG")
    assert "train_loss: " in report.stdout and "checkpoints at steps [6]" in report.stdout  # the best by val_loss
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["vocab_size"] == 8448  # linked from the tokenizer
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    assert checkpoints and all((c / "lightning_state.pt").is_file() for c in checkpoints)
    assert "last.ckpt" in {c.name for c in checkpoints}
    assert not (tmp_path / "flight_recorder").exists()  # the config's FlightRecorder watched a clean run


@pytest.mark.multiprocess  # `titan fit` in a subprocess, which starts its ranks
def test_a_transformers_model_trains_from_its_config(tmp_path: Path, test_env: dict[str, str]) -> None:
    # configs/hf_causal_lm.yaml: llama_module.CausalLM, a Qwen2 from its config, no plan, on 2 processes.
    fit = run_command([sys.executable, "-m", "llama_module.cli", "fit", "--config",
                       str(REPO / "configs" / "hf_causal_lm.yaml"), "--trainer.max_steps=4",
                       "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
                       "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}",
                       "--trainer.enable_progress_bar=false"], test_env, tmp_path)
    assert re.search(r"Checkpoint of step 4 published", fit.stdout + fit.stderr)
    scalars, _ = read_scalars(tmp_path)
    assert len(scalars["train_loss"]) == 4 and len(scalars["val_loss"]) == 2
    assert scalars["train_loss"][-1][1] < scalars["train_loss"][0][1]


@pytest.mark.unit
@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(config: Path, capsys: pytest.CaptureFixture) -> None:
    from llama_module.cli import titan_cli

    with pytest.raises(SystemExit) as exit_info:
        titan_cli(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    assert "titan_strategy.TitanStrategy" in capsys.readouterr().out


@pytest.mark.unit
def test_titan_help_lists_every_tool(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from llama_module.cli import main

    monkeypatch.setattr(sys, "argv", ["titan", "--help"])
    with pytest.raises(SystemExit):
        main()
    out = capsys.readouterr().out
    for command in ("fit", "validate", "titan plan", "titan rehearse", "titan-hf export", "titan-fr analyze"):
        assert command in out


@pytest.mark.unit
def test_lightnings_amp_line_gives_way_to_what_the_strategy_runs(caplog: pytest.LogCaptureFixture) -> None:
    import lightning as L

    from titan_strategy import TitanStrategy

    with caplog.at_level("INFO"):
        L.Trainer(strategy=TitanStrategy(), accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    assert "Automatic Mixed Precision" not in caplog.text  # configure_precision says bf16-mixed "as" what, at setup
