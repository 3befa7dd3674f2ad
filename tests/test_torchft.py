"""torchft replica groups: HSDP's replicas as separate jobs that train on when one dies and take a live peer's state
when it comes back, with no restart of the survivors (``titan_strategy.fault_tolerance``).

Each group is its own 2-rank job (FSDP inside), meeting the other through a lighthouse this test starts. Every
group's loader yields the same rows; the live groups split them, so a step trains the same global batch whether
one group or two are alive: every step's loss matches the single-process run, through the outage too.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from torchft.coordination import LighthouseServer

from tests.conftest import free_port, launch
from tests.support.parity import BASE_RUN, GLOBAL_BATCH, ReferenceRun, series
from tests.support.run_spec import RunSpec
from titan_strategy import TitanStrategy
from titan_strategy.fault_tolerance import check_lighthouse_answers

GROUPS = 2
RANKS_PER_GROUP = 2
RTOL = 1e-5


@contextmanager
def lighthouse(min_replicas: int) -> Iterator[str]:
    # A dead group is dropped after a 1 s heartbeat timeout; the first quorum waits up to 10 s for the other group.
    server = LighthouseServer(bind=f"[::]:{free_port()}", min_replicas=min_replicas, join_timeout_ms=10_000,
                              heartbeat_timeout_ms=1000)
    try:
        yield server.address()
    finally:
        server.shutdown()


def _group_run(address: str, group: int, run: RunSpec = BASE_RUN, strategy_knobs: dict[str, Any] | None = None,
               batch_size: int = GLOBAL_BATCH // RANKS_PER_GROUP, model_checkpoint: dict[str, Any] | None = None,
               **drills: Any) -> RunSpec:
    """Replica group ``group``'s part of ``run``; ``drills``: DrillSpec's fields. Every in-group data rank loads the
    rows of all groups: GLOBAL_BATCH / RANKS_PER_GROUP under FSDP."""
    return run.with_(
        batch_size=batch_size, checkpoints={"model_checkpoint": model_checkpoint},
        drills=dict(record_parameter_digest=True, **drills),
        trainer={"timeout_seconds": 20, "strategy": {
            "fault_tolerance": "torchft", "data_parallel_replicate_size": GROUPS, "torchft_lighthouse": address,
            "replica_group_id": group, **(strategy_knobs or {})}})


def _wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} was not written within {timeout_s} s"
        time.sleep(0.1)


def _in_background(run: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``run`` in a thread; the returned function waits for it and returns its result or raises its error."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = run()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    return wait


def _assert_matches(records: list[dict[str, Any]], single_process: dict[str, Any], what: str) -> None:
    expected = {step["step"]: step["train_loss"] for step in single_process["steps"]}
    for rank, record in enumerate(records):
        for step in record["steps"]:
            assert step["train_loss"] == pytest.approx(expected[step["step"]], rel=RTOL), (
                f"{what}, rank {rank}, step {step['step']}: {step['train_loss']} vs one process "
                f"{expected[step['step']]}")


# Inside each group: FSDP over its 2 ranks, or TP over them (one data rank loading all 8 rows of the step).
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}], ids=["fsdp2", "tp2"])
def test_replica_groups_without_a_failure_train_as_one_process(layout: dict[str, int], reference_run: ReferenceRun,
                                                                tmp_path: Path, test_env: dict[str, str]) -> None:
    single_process = reference_run(BASE_RUN)
    # Each group saves its own checkpoints (DCP inside the group), here at steps 5 and 10.
    folders = [tmp_path / f"checkpoints{g}" for g in range(GROUPS)]
    with lighthouse(min_replicas=GROUPS) as address:  # both groups in every quorum
        data_ranks = RANKS_PER_GROUP // layout.get("tensor_parallel_size", 1)
        waits = [_in_background(lambda g=g: launch(RANKS_PER_GROUP, _group_run(
            address, g, strategy_knobs=layout, batch_size=GLOBAL_BATCH // data_ranks,
            model_checkpoint={"dirpath": str(folders[g]), "every_n_train_steps": 5, "save_top_k": -1}),
            tmp_path / f"group{g}", test_env)) for g in range(GROUPS)]
        groups = [wait() for wait in waits]
    for folder in folders:
        assert sorted(path.name for path in folder.iterdir() if (path / "titan_checkpoint.json").is_file()) == [
            "epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt"]
    for group, records in enumerate(groups):
        assert [step["step"] for step in records[0]["steps"]] == list(range(1, BASE_RUN.steps + 1))
        _assert_matches(records, single_process, f"group {group}")
        assert series(records[0], "grad_norm") == pytest.approx(series(single_process, "grad_norm"), rel=RTOL)
    assert [r["parameter_digest"] for r in groups[0]] == [r["parameter_digest"] for r in groups[1]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("data", ["affine", "text"])  # a map-style DataLoader; TextDataModule's packed windows
def test_a_dead_group_leaves_the_survivor_training_and_rejoins_with_its_state(
        data: str, reference_run: ReferenceRun, tmp_path: Path, test_env: dict[str, str]) -> None:
    run = BASE_RUN.with_(data={"kind": data})
    single_process = reference_run(run)
    killed_at, alone_until, rejoin_by = 5, 7, 8
    files = {name: str(tmp_path / name) for name in ("group0_started", "group1_started", "group0_alone",
                                                     "group1_relaunched")}
    # Each group's set-up waits until the other has started, so that both are in the first quorum. Group 1 is
    # relaunched once group 0 has trained alone up to step 7; group 0 waits at step 8 for that relaunch, so that it
    # rejoins before the run ends (the grace lets the relaunched group's set-up reach its quorum request).
    gate = lambda step, name: {"step": step, "file": files[name], "grace_s": 5 if step else 0}  # noqa: E731
    announce = lambda step, name: [{"step": step, "file": files[name]}]  # noqa: E731
    # Group 1 checkpoints every 3 steps and auto-resumes: its relaunch loads step 3 from disk, then takes the live
    # group's newer state as it joins.
    folder = tmp_path / "group1_checkpoints"
    group1 = {"strategy_knobs": {"auto_resume": True},
              "model_checkpoint": {"dirpath": str(folder), "every_n_train_steps": 3, "save_top_k": -1}}
    with lighthouse(min_replicas=1) as address:
        survivor = _in_background(lambda: launch(RANKS_PER_GROUP, _group_run(
            address, 0, run, announce_files=announce(0, "group0_started") + announce(alone_until, "group0_alone"),
            wait_for_files=[gate(0, "group1_started"), gate(rejoin_by, "group1_relaunched")]),
            tmp_path / "group0", test_env))
        # Both ranks of group 1 die after step 5's forward, inside the step the survivor is training with them.
        with pytest.raises(AssertionError, match="SIGKILL|Signals.SIGKILL|-9"):
            launch(RANKS_PER_GROUP, _group_run(
                address, 1, run, announce_files=announce(0, "group1_started"),
                wait_for_files=[gate(0, "group0_started")],
                interrupt={"ranks": [0, 1], "step": killed_at, "signal": "SIGKILL", "at": "backward"}, **group1),
                   tmp_path / "group1_killed", test_env)
        assert [path.name for path in folder.glob("*.ckpt")] == ["epoch=0-step=3.ckpt"]
        _wait_for(Path(files["group0_alone"]))
        rejoined = launch(RANKS_PER_GROUP, _group_run(address, 1, run, announce_files=announce(0, "group1_relaunched"),
                                                      **group1), tmp_path / "group1_rejoined", test_env)
        survived = survivor()
    steps = [step["step"] for step in survived[0]["steps"]]
    assert steps == list(range(1, run.steps + 1)), "the survivor trains every step, without a restart"
    # The same global batch every step, whoever is alive: no sample skipped or trained twice.
    _assert_matches(survived, single_process, "surviving group 0")
    first = rejoined[0]["steps"][0]["step"]
    assert alone_until < first <= rejoin_by + 1 and rejoined[0]["steps"][-1]["step"] == run.steps, rejoined[0]
    _assert_matches(rejoined, single_process, "rejoined group 1")
    # Recovered from the live peer, then stepped with it: bitwise the same shards at the end.
    assert [r["parameter_digest"] for r in rejoined] == [r["parameter_digest"] for r in survived]
    times = [step["time"] for step in survived[0]["steps"]]
    durations = [later - earlier for earlier, later in zip(times, times[1:])]
    stall = durations[killed_at - 2] - statistics.median(durations[: killed_at - 2])
    print(f"torchft drill: the survivor's step {killed_at} took {durations[killed_at - 2]:.2f} s (stall {stall:.2f} s "
          f"over the median step); group 1 rejoined at step {first}.")
    assert stall < 30, durations


@pytest.mark.unit
@pytest.mark.parametrize(("knobs", "message"), [
    ({"data_parallel_replicate_size": 1}, "data_parallel_replicate_size=1 leaves no other group"),
    ({"data_parallel_replicate_size": 2, "pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not built"),
    ({"data_parallel_replicate_size": 2, "replica_group_id": 0}, "needs a lighthouse"),
    ({"data_parallel_replicate_size": 2, "torchft_lighthouse": "http://127.0.0.1:1"}, "needs this job's replica"),
    ({"data_parallel_replicate_size": 2, "torchft_lighthouse": "http://127.0.0.1:1", "replica_group_id": 2},
     r"replica_group_id=2 is outside 0 \.\. 1"),
    ({"data_parallel_replicate_size": 2, "min_replica_groups": 3}, "min_replica_groups=3 exceeds"),
])
def test_impossible_replica_groups_fail_when_the_strategy_is_built(knobs: dict[str, Any], message: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("TITAN_REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ValueError, match=message):
        TitanStrategy(fault_tolerance="torchft", **knobs)


@pytest.mark.unit
def test_a_lighthouse_that_does_not_answer_is_named_with_the_fix() -> None:
    # Each rank checks this in the strategy's setup_environment, before the model is built.
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConnectionError, match=f"No torchft lighthouse answers at {address}.*torchft_lighthouse"):
        check_lighthouse_answers(address)
