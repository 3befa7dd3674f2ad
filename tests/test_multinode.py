"""Several nodes through the launcher people use: two ``torchrun`` agents, one per "node", on this machine.

Each agent starts 2 ranks of tests/support/train_worker.py; Lightning reads the TorchElastic environment (RANK,
GROUP_RANK...) and TitanStrategy builds HSDP with the replicas across the nodes and FSDP within each, as on
a real cluster. The losses must match one process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LAUNCH_TIMEOUT_S, REPO, free_port
from tests.support.parity import BASE_RUN, GLOBAL_BATCH, ReferenceRun, assert_close_per_step, series

WORKER = REPO / "tests" / "support" / "train_worker.py"


@pytest.mark.multiprocess
def test_two_torchrun_nodes_train_hsdp_across_them_as_one_process(reference_run: ReferenceRun, tmp_path: Path,
                                                                 test_env: dict[str, str]) -> None:
    spec = BASE_RUN.with_(batch_size=GLOBAL_BATCH // 4, devices=2, num_nodes=2,
                          trainer={"strategy": {"data_parallel_replicate_size": 2}})
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.to_json())
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
         str(WORKER), str(spec_file), str(tmp_path)],
        env=test_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    errors = "".join(f"\n{path.name}: {path.read_text()}" for path in sorted(tmp_path.glob("rank*.error")))
    assert [agent.returncode for agent in agents] == [0, 0], f"{errors}\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}"
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    single_process = reference_run(BASE_RUN)
    for record in records:
        assert_close_per_step(series(record, "train_loss"), series(single_process, "train_loss"))
    assert_close_per_step(series(records[0], "grad_norm"), series(single_process, "grad_norm"))
