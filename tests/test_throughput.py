"""The Throughput callback: its arithmetic, and that it counts per device right under TP and PP."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from tests.conftest import launch
from tests.support.run_spec import CallbackSpec, DataSpec, RunSpec, TrainerSpec
from tests.support.train_worker import TINY, AffineSequences
from titan_strategy import Throughput
from titan_strategy.callbacks.throughput import ThroughputWindow, peak_tflops_of

SEQ_LEN = 32
GLOBAL_BATCH = 8
EVERY = 2


@pytest.mark.unit
def test_window_arithmetic() -> None:
    window = ThroughputWindow(tokens=16384 * 10, seconds=3.0, data_seconds=0.3, ranks_per_batch=4,
                              flops_per_token=1e10, peak_tflops=989.0)
    assert window.tokens_per_s_per_device == pytest.approx(16384 * 10 / 3.0 / 4)
    assert window.tflops_per_device == pytest.approx(window.tokens_per_s_per_device * 1e10 / 1e12)
    assert window.mfu == pytest.approx(window.tflops_per_device / 989.0)
    assert window.metrics()["throughput/data_loading_percent"] == pytest.approx(10.0)
    unknown = ThroughputWindow(tokens=1, seconds=1.0, data_seconds=0.0, ranks_per_batch=1, flops_per_token=None,
                               peak_tflops=None)
    assert set(unknown.metrics()) == {"throughput/tokens_per_s_per_device", "throughput/data_loading_percent"}


@pytest.mark.unit
@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                            ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                            ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0), ("Tesla T4", None)])
def test_peak_table(name: str, peak: float | None) -> None:
    assert peak_tflops_of(name) == peak


@pytest.mark.unit
def test_flops_per_token_of_the_1b_shape() -> None:
    # Llama-3.2-1B shape, untied output: 1.236e9 non-embedding parameters, and attention at seq 8192.
    module = LlamaModule(model="1B")
    non_embedding = 16 * (2048 * 64 * (2 * 32 + 2 * 8) + 3 * 2048 * 8192 + 2 * 2048) + 2048 + 128256 * 2048
    assert module.flops_per_token(8192) == 6 * non_embedding + 12 * 16 * 2048 * 8192


@pytest.mark.unit  # Lightning's single-device fit, in this process
def test_logs_to_the_trainers_loggers_with_any_strategy(tmp_path: Path) -> None:
    module = LlamaModule(model=TINY, warmup_steps=1, decay_steps=10)
    logger = CSVLogger(tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Throughput(log_every_n_steps=3, peak_tflops=1.0)])
    trainer.fit(module, DataLoader(AffineSequences(64, SEQ_LEN, TINY.vocab_size), batch_size=2))
    logged = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = logged[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in logged[1:]]
    tokens = [row for row in rows if row.get("throughput/tokens_per_s_per_device")]
    # Batch 1 is left out (warm-up); windows end after batches 4 and 7, at global steps 4 and 7.
    assert [int(row["step"]) for row in tokens] == [4, 7]
    assert all(float(row["throughput/mfu_percent"]) > 0 for row in tokens)
    assert {"tok/s", "mfu%"} <= set(trainer.progress_bar_metrics)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("nproc", "strategy", "ranks_per_batch"), [
    (4, {"data_parallel_shard_size": 2, "tensor_parallel_size": 2}, 2),
    (4, {"data_parallel_shard_size": 2, "pipeline_parallel_size": 2}, 2),
], ids=["dp2xtp2", "dp2xpp2"])
def test_per_device_rate_is_the_global_rate_over_the_world(nproc: int, strategy: dict, ranks_per_batch: int,
                                                            tmp_path: Path, test_env: dict[str, str]) -> None:
    steps = 1 + 2 * EVERY  # the first batch is warm-up, then two windows
    dp = nproc // ranks_per_batch
    spec = RunSpec(steps=steps, batch_size=GLOBAL_BATCH // dp, data=DataSpec(seq_len=SEQ_LEN),
                   trainer=TrainerSpec(strategy=strategy),
                   callbacks=CallbackSpec(throughput={"log_every_n_steps": EVERY}))
    records = launch(nproc, spec, tmp_path, test_env)
    flops_per_token = LlamaModule(model=TINY).flops_per_token(SEQ_LEN)
    for record in records:
        assert len(record["throughput"]) == 2
        for window in record["throughput"]:
            assert window["ranks_per_batch"] == ranks_per_batch
            assert window["tokens"] == GLOBAL_BATCH // dp * SEQ_LEN * EVERY  # the full sequences of its dp share
            # Every token the job trained on in the window, spread over every device of the job.
            job_rate_per_device = GLOBAL_BATCH * SEQ_LEN * EVERY / window["seconds"] / nproc
            assert window["throughput/tokens_per_s_per_device"] == pytest.approx(job_rate_per_device)
            assert window["throughput/tflops_per_device"] == pytest.approx(job_rate_per_device * flops_per_token / 1e12)
            assert "throughput/mfu_percent" not in window  # no known peak on a CPU
            assert 0 <= window["throughput/data_loading_percent"] < 100
