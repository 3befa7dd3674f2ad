"""`titan plan`: memory against measured peaks, the paper's scenarios, `--check`, and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_module.args import LlamaConfig, get_flavor
from llama_module.plan_cli import main as titan_plan
from llama_module.plan_cli import model_shape
from titan_strategy.planner.estimate import Job, Layout, estimate
from titan_strategy.planner.hardware import get_gpu
from titan_strategy.planner.search import PlanError, check_layout, plan_layouts

REPO = Path(__file__).resolve().parents[1]
ONE_GPU = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "cp": 1, "pp": 1, "schedule": None, "microbatches": 1,
           "stages_per_rank": 1, "float8": False}


@pytest.mark.parametrize(("shape", "batch", "measured_gib"), [
    # Peak allocated of the plain-loop reference runs on one H200 (benchmarks/RESULTS.md, issue #8): they free
    # the gradients before the forward, as TitanStrategy does now.
    (get_flavor("1B"), 2, 45.4),
    (LlamaConfig(dim=4096, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336), 1, 74.5),
], ids=["1B", "8B-width"])
def test_peak_memory_within_15_percent_of_the_measured_gpu_runs(shape: LlamaConfig, batch: int,
                                                                 measured_gib: float) -> None:
    job = Job(gpus=1, gpus_per_node=1, gpu=get_gpu("H200"), seq_len=8192, global_batch_tokens=8192 * batch)
    estimated = estimate(model_shape(shape), Layout(**ONE_GPU, ac="none"), job).peak_allocated_gib
    assert estimated == pytest.approx(measured_gib, rel=0.15)


def _top3(flavor: str, gpus: int, seq_len: int, tokens: int) -> list[tuple]:
    job = Job(gpus=gpus, gpus_per_node=8, gpu=get_gpu("H100"), seq_len=seq_len, global_batch_tokens=tokens)
    return [(p.layout.dp, p.layout.tp, p.layout.cp, p.layout.pp) for p in plan_layouts(model_shape(get_flavor(flavor)),
                                                                                      job, top=3)]


def test_paper_8b_on_128_gpus_1d_data_parallel_is_in_the_top_3() -> None:
    # The paper's 1-D layout; the planner proposes its HSDP form (shards within a node, replicas across).
    assert (128, 1, 1, 1) in _top3("8B", 128, 8192, 2 * 8192 * 128)


def test_paper_8b_fsdp_speed_matches_the_published_number() -> None:
    # TorchTitan paper: 8B, 128 H100s, FSDP, bf16, selective AC, compile: 5,762 tokens/s per GPU.
    job = Job(gpus=128, gpus_per_node=8, gpu=get_gpu("H100"), seq_len=8192, global_batch_tokens=2 * 8192 * 128)
    layout = Layout(**{**ONE_GPU, "dp_shard": 128}, ac="selective_op")
    assert estimate(model_shape(get_flavor("8B")), layout, job).tokens_per_s_per_gpu == pytest.approx(5762, rel=0.1)


def test_paper_8b_at_262144_tokens_on_8_gpus_cp8_is_in_the_top_3() -> None:
    assert (1, 1, 8, 1) in _top3("8B", 8, 262144, 262144)


def test_more_memory_per_layer_than_the_gpu_has_is_refused_with_the_reason() -> None:
    job = Job(gpus=8, gpus_per_node=8, gpu=get_gpu("H100"), seq_len=8192, global_batch_tokens=8 * 8192)
    with pytest.raises(PlanError, match=r"No layout of 8 x H100 \(80 GiB\) fits.*6,048 GiB"):
        plan_layouts(model_shape(get_flavor("405B")), job)


def test_a_layout_that_cannot_run_names_the_problem_and_the_nearest_that_fits() -> None:
    job = Job(gpus=8, gpus_per_node=8, gpu=get_gpu("H100"), seq_len=8192, global_batch_tokens=16 * 8192)
    bad = Layout(**{**ONE_GPU, "dp_shard": 8}, ac="none")  # 8B, 2 sequences per GPU, no AC: over 80 GiB
    with pytest.raises(PlanError, match=r"needs \d+\.\d GiB per GPU, more than the 80 GiB.*nearest layout that "
                                        r"fits: .*ac=(selective_op|full)"):
        check_layout(model_shape(get_flavor("8B")), bad, job)


def test_cli_plans_draws_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    png = tmp_path / "plan.png"
    assert titan_plan(["--model", "8B", "--gpus", "16", "--gpu", "H200", "--top", "3", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s/GPU" in out and "Why #1" in out and png.stat().st_size > 10_000
    assert titan_plan(["--check", str(REPO / "configs" / "llama3_8b_fsdp.yaml"), "--gpu", "H100"]) == 0
    assert "fits" in capsys.readouterr().out


def test_cli_check_refuses_a_config_that_does_not_divide(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = (REPO / "configs" / "llama3_8b_fsdp.yaml").read_text().replace(
        "data_parallel_shard_size: -1", "data_parallel_shard_size: -1\n      tensor_parallel_size: 3")
    (tmp_path / "bad.yaml").write_text(config)
    assert titan_plan(["--check", str(tmp_path / "bad.yaml")]) == 1
    error = capsys.readouterr().err
    assert "tp=3 does not divide n_heads=32" in error and "nearest layout that fits" in error
    assert titan_plan(["--gpus", "12", "--gpus-per-node", "8"]) == 1
    assert "gpus=12 is not a multiple of gpus_per_node=8" in capsys.readouterr().err


def test_titan_fit_plan_check_stops_a_run_that_cannot_fit_before_anything_starts(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture) -> None:
    from llama_module.cli import TitanCLI
    from llama_module.data import TextDataModule
    from llama_module.module import LlamaModule

    with pytest.raises(SystemExit, match=r"--plan_check H100: The layout cannot run: it needs \d+\.\d GiB per GPU"):
        TitanCLI(LlamaModule, TextDataModule, args=["fit", "--config", str(REPO / "configs" / "llama3_8b_fsdp.yaml"),
                                                    "--model.model=405B", "--plan_check=H100",
                                                    f"--trainer.default_root_dir={tmp_path}"])
    assert list(tmp_path.iterdir()) == []
