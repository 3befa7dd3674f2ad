"""FlightRecorder and ``titan-fr analyze``: hang drills that must end, dump on every rank and be explained.

Each drill's launch is bounded (``DRILL_LIMIT_S``): a drill that hangs fails instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import launch
from tests.support.parity import (
    BASE_RUN,
    GLOBAL_BATCH,
    ReferenceRun,
    assert_close_per_step,
    series,
)
from tests.support.run_spec import CallbackSpec, DrillSpec, RunSpec, TrainerSpec
from titan_strategy import FlightRecorder
from titan_strategy.flight_recorder.analyze import (
    diagnose,
    format_report,
    unmatched_p2p,
)
from titan_strategy.flight_recorder.cli import main as titan_fr
from titan_strategy.flight_recorder.dump import (
    NCCL_DUMP_PREFIX,
    RankDump,
    dump_dirs,
    read_dumps,
)
from titan_strategy.flight_recorder.watchdog import Watchdog

DRILL_LIMIT_S = 120
DRILL_TIMEOUT_S = 6  # the steady-state timeout the drills run with: a stuck rank gives up after this


def _drill(nproc: int, strategy: dict[str, Any], drill: dict[str, Any], out: Path, env: dict[str, str]) -> Path:
    """Run a sabotaged training job that must fail within the limit; return its one run folder of dumps."""
    spec = RunSpec(steps=6, batch_size=GLOBAL_BATCH // nproc, trainer=TrainerSpec(clip=1.0, strategy=strategy),
                   drills=DrillSpec(hang=drill),
                   callbacks=CallbackSpec(flight_recorder={"timeout_s": DRILL_TIMEOUT_S, "dump_dir": str(out / "fr")}))
    with pytest.raises(AssertionError, match="failed"):
        launch(nproc, spec, out, env, timeout_s=DRILL_LIMIT_S)
    [run] = dump_dirs(out / "fr")
    assert sorted(p.name for p in run.glob("rank_*.json")) == [f"rank_{r}.json" for r in range(nproc)]
    return run


def _analyze(run: Path, capsys: pytest.CaptureFixture[str]) -> str:
    # From the drill's own folder, two levels above the dumps (OUT/fr/<run-id>/rank_N.json), as a user would.
    assert titan_fr(["analyze", str(run.parent.parent)]) == 0
    assert (run / "timeline.png").read_bytes().startswith(b"\x89PNG")
    return capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.parametrize(("nproc", "strategy", "skipper"), [(2, {}, 1), (4, {"tensor_parallel_size": 2}, 2)],
                         ids=["dp2", "dp2xtp2"])
def test_a_skipped_collective_is_named(nproc: int, strategy: dict, skipper: int, tmp_path: Path,
                                       test_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    # The skipped op is the all-reduce of step 3's token loss sums; the others wait for it in vain.
    run = _drill(nproc, strategy, {"rank": skipper, "step": 3, "skip": "all_reduce"}, tmp_path, test_env)
    skipped = json.loads((tmp_path / "skipped.json").read_text())
    cause = diagnose(read_dumps(run)).problems[0]
    assert (cause.group, cause.missing, cause.expected.name) == (skipped["group"], [skipper], "all_reduce")
    assert cause.ranks == skipped["ranks"]
    report = _analyze(run, capsys)
    assert f"Likely cause: ranks [{skipper}] never issued collective #{cause.seq} all_reduce" in report


@pytest.mark.multiprocess
def test_a_stalled_pipeline_stage_shows_the_last_sends_and_receives(tmp_path: Path, test_env: dict[str, str],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # Stage 0 sleeps after its forward in step 3, before sending the activations; stage 1 waits to receive.
    run = _drill(2, {"pipeline_parallel_size": 2, "pipeline_microbatches": 4}, {"rank": 0, "step": 3, "stall_s": 600},
                 tmp_path, test_env)
    diagnosis = diagnose(read_dumps(run))
    first, last = diagnosis.p2p
    assert first.last_send is not None and first.last_send.peer == 1 and not first.pending
    assert last.last_recv is not None and last.last_recv.peer == 0
    assert [(op.name, op.peer) for op in last.pending] == [("recv", 0)]
    assert last.pending[0].seq > last.last_recv.seq
    [cause] = unmatched_p2p(diagnosis)
    assert "rank 0 never posted the matching send" in cause
    assert any("train_worker.py" in frame for frame in diagnosis.stacks[0][-2:])  # the stall itself
    report = _analyze(run, capsys)
    assert "Pipeline point-to-point (last completed per stage)" in report and "not completed: #" in report


@pytest.mark.multiprocess
def test_a_clean_run_dumps_nothing_and_trains_the_same(reference_run: ReferenceRun, tmp_path: Path,
                                                       test_env: dict[str, str]) -> None:
    # Pipeline parallel: the gloo send/receive recording is in the path of every step.
    single_process = reference_run(BASE_RUN)
    spec = BASE_RUN.with_(trainer={"strategy": {"pipeline_parallel_size": 2, "flight_recorder": True}})
    records = launch(2, spec, tmp_path, test_env)
    assert all("FlightRecorder" in record["callbacks"] for record in records)  # the knob added one
    assert not (tmp_path / "flight_recorder").exists()
    assert_close_per_step(series(records[0], "train_loss"), series(single_process, "train_loss"))
    assert_close_per_step(series(records[0], "grad_norm"), series(single_process, "grad_norm"))


@pytest.mark.parametrize("accelerator", [pytest.param("cpu", marks=pytest.mark.multiprocess),
                                         pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_signal_dumps_on_demand_and_training_goes_on(accelerator: str, tmp_path: Path,
                                                        test_env: dict[str, str]) -> None:
    if accelerator == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU (NCCL's trace)")
    nproc = 2 if accelerator == "cpu" else 1
    spec = RunSpec(steps=5, batch_size=GLOBAL_BATCH // nproc, accelerator=accelerator, trainer=TrainerSpec(strategy={}),
                   callbacks=CallbackSpec(flight_recorder={"dump_dir": str(tmp_path / "fr")}),
                   drills=DrillSpec(hang={"rank": 0, "step": 3, "signal": "SIGUSR2"}))
    records = launch(nproc, spec, tmp_path, test_env)
    assert all(record["global_step"] == 5 for record in records)
    [run] = dump_dirs(tmp_path / "fr")
    assert [p.name for p in run.glob("rank_*.json")] == ["rank_0.json"]  # only the signalled rank
    [ours] = read_dumps(run).values()
    assert ours.titan["reason"] == "signal SIGUSR2" and ours.entries
    # On CUDA the strategy's checkpoint group is gloo, so gloo entries may appear beside NCCL's.
    backends = {entry["profiling_name"].split(":")[0] for entry in ours.entries}
    assert ("gloo" if accelerator == "cpu" else "nccl") in backends and backends <= {"gloo", "nccl"}, backends
    # torch's own pickled format (what NCCL writes on a timeout) reads into the same ops.
    [native] = read_dumps(tmp_path / "native").values()
    diagnosis = diagnose({0: native})
    assert diagnosis.ops[0] and not diagnosis.problems
    if accelerator == "cuda":
        assert all(op.completed for op in diagnosis.ops[0][:-1])
        assert any(op.frames for op in diagnosis.ops[0])  # NCCL records the Python stack of each op


def _watch(timeout_s: float, dump_signal: int | None) -> tuple[Watchdog, list[str], threading.Event]:
    reasons: list[str] = []
    dumped = threading.Event()

    def dump(reason: str) -> None:
        reasons.append(reason)
        dumped.set()

    watchdog = Watchdog(dump, timeout_s, store_key="unused", dump_signal=dump_signal, exit_on_hang=False, poll_s=0.05)
    watchdog.start()
    return watchdog, reasons, dumped


@pytest.mark.unit
def test_the_watchdog_dumps_on_an_overrun_and_on_its_signal() -> None:
    watchdog, reasons, dumped = _watch(0.3, signal.SIGUSR2)
    try:
        watchdog.arm("training batch 7")
        assert dumped.wait(5) and reasons == ["training batch 7 exceeded 0.3 s"]
        dumped.clear()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert dumped.wait(5) and reasons[-1] == "signal SIGUSR2"
        dumped.clear()
        watchdog.arm("training batch 8")
        watchdog.disarm()  # a batch that ends in time dumps nothing
        assert not dumped.wait(0.6)
    finally:
        watchdog.stop()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


@pytest.mark.unit
def test_off_the_main_thread_the_watchdog_runs_without_its_signal() -> None:
    started: list[tuple] = []

    def start_elsewhere() -> None:
        with pytest.warns(UserWarning, match="SIGUSR2 will not dump"):
            started.append(_watch(0.3, signal.SIGUSR2))

    thread = threading.Thread(target=start_elsewhere)
    thread.start()
    thread.join()
    [(watchdog, reasons, dumped)] = started
    try:
        watchdog.arm("training batch 1")
        assert dumped.wait(5) and reasons == ["training batch 1 exceeded 0.3 s"]
    finally:
        watchdog.stop()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def _nccl_entry(seq: int, name: str, state: str, created: int, sizes: list, group: str = "0") -> dict[str, Any]:
    return {"process_group": [group, "default_pg"], "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
            "profiling_name": f"nccl:{name}", "state": state, "time_created_ns": created, "input_sizes": sizes,
            "input_dtypes": ["Float"], "frames": [{"name": "train_step", "filename": "train.py", "line": 42}]}


@pytest.mark.unit
def test_nccl_dumps_are_read_and_a_lagging_rank_is_named(tmp_path: Path) -> None:
    # NCCL's own dump format (what TORCH_NCCL_DUMP_ON_TIMEOUT writes): a pickle per rank, pg_config filled in.
    pg_config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    for rank in range(3):
        entries = [_nccl_entry(seq, "all_reduce", "completed", seq * 10, [[4]]) for seq in (1, 2)]
        if rank != 2:  # rank 2 never reaches the third all-gather
            entries.append(_nccl_entry(3, "_allgather_base", "started", 30 + rank, [[8]]))
        trace = {"version": "2.10", "pg_config": pg_config, "pg_status": {}, "entries": entries}
        (tmp_path / f"{NCCL_DUMP_PREFIX}{rank}").write_bytes(pickle.dumps(trace))
    diagnosis = diagnose(read_dumps(tmp_path))
    [cause] = diagnosis.problems
    assert (cause.seq, cause.missing, cause.expected.name) == (3, [2], "_allgather_base")
    assert diagnosis.progress == {"0": {0: 3, 1: 3, 2: 2}}
    assert diagnosis.stacks[0] == ["train.py:42 in train_step"]
    assert "ranks [2] never issued collective #3 _allgather_base [8] Float" in format_report(diagnosis)


@pytest.mark.unit
def test_a_skipper_is_told_from_the_rank_it_skipped_with_by_the_step_pattern() -> None:
    # Rank 0 skips the 3rd step's all-reduce: its next all-gather lands on the all-reduce's number. Two
    # ranks disagree at #6 and a vote cannot tell who is wrong; the earlier steps (all-gather, then
    # all-reduce) can.
    pattern = [("_allgather_base", [[8]]), ("all_reduce", [[1]])] * 3
    issued = {0: pattern[:4] + [pattern[4], pattern[4]], 1: pattern}
    dumps = {rank: RankDump(rank=rank, pg_config={"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                            entries=[_nccl_entry(seq, name, "started", seq * 10 + rank, sizes)
                                     for seq, (name, sizes) in enumerate(ops, start=1)])
             for rank, ops in issued.items()}
    [cause] = diagnose(dumps).problems
    assert (cause.seq, cause.missing, cause.expected.name) == (6, [0], "all_reduce")
    assert cause.issued_instead[0].name == "_allgather_base"


@pytest.mark.unit
def test_the_cause_is_the_skip_even_when_another_wait_began_first() -> None:
    # Each step: all-gather on group a, all-reduce on b, reduce-scatter on a. In step 6 rank 1 skips the
    # all-reduce and waits in the reduce-scatter, which it (on a loaded machine) issued before rank 0
    # issued the all-reduce. Rank 1 broke its own pattern, so group b's problem is the cause.
    pattern = [("a", "_allgather_base"), ("b", "all_reduce"), ("a", "_reduce_scatter_base")]
    issued = {0: pattern * 5 + pattern[:2], 1: pattern * 5 + [pattern[0], pattern[2]]}
    late = {0: 200, 1: 100}  # when each rank issued its last op
    configs = {name: {"name": name, "desc": name, "ranks": "[0, 1]"} for name in "ab"}
    dumps = {}
    for rank, ops in issued.items():
        seqs: dict[str, int] = defaultdict(int)
        entries = []
        for index, (group, name) in enumerate(ops):
            seqs[group] += 1
            created = late[rank] if index == len(ops) - 1 else index
            entries.append(_nccl_entry(seqs[group], name, "started", created, [[4]], group))
        dumps[rank] = RankDump(rank=rank, entries=entries, pg_config=configs)
    diagnosis = diagnose(dumps)
    cause = diagnosis.problems[0]
    assert (cause.group, cause.missing, cause.expected.name) == ("b", [1], "all_reduce")
    assert list(diagnosis.departures) == [1]


@pytest.mark.unit
def test_a_dump_that_holds_objects_is_refused(tmp_path: Path) -> None:
    (tmp_path / f"{NCCL_DUMP_PREFIX}0").write_bytes(pickle.dumps({"entries": [Path("/")]}))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load pathlib"):
        read_dumps(tmp_path)


@pytest.mark.unit
def test_titan_fr_analyzes_the_newest_run_found_at_any_depth_and_lists_the_others(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = {"entries": [], "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}},
            "titan": {"rank": 0, "reason": "test"}}
    older, newer = tmp_path / "lightning_logs" / "flight_recorder" / "a", tmp_path / "flight_recorder" / "b"
    for age, folder in enumerate((older, newer)):
        folder.mkdir(parents=True)
        (folder / "rank_0.json").write_text(json.dumps(dump))
        os.utime(folder, (1_000_000 + age, 1_000_000 + age))
    assert dump_dirs(tmp_path) == [older, newer]
    assert titan_fr(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"analysing the newest, {newer}" in out and f"  {older}\n" in out
    assert (newer / "timeline.png").exists() and not (older / "timeline.png").exists()


@pytest.mark.unit
def test_titan_fr_explains_an_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        titan_fr(["analyze", str(tmp_path)])
    assert "no Flight Recorder dumps" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"buffer_size": 0}, "buffer_size=0"),
    ({"timeout_s": -1}, "timeout_s=-1"),
    ({"dump_signal": "SIGNOPE"}, "dump_signal='SIGNOPE'"),
])
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FlightRecorder(**kwargs)


@pytest.mark.unit
def test_a_separate_nccl_recorder_is_merged_in_time_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 records NCCL ops apart from the other backends; a dump must hold both."""
    from titan_strategy.flight_recorder import dump

    ops = torch._C._distributed_c10d
    gloo = {"entries": [{"record_id": 0, "time_created_ns": 20, "profiling_name": "gloo:barrier"}], "pg_config": {}}
    nccl = {"entries": [{"record_id": 0, "time_created_ns": 10, "profiling_name": "nccl:all_reduce"},
                        {"record_id": 1, "time_created_ns": 30, "profiling_name": "nccl:all_gather"}],
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}}}
    monkeypatch.setattr(ops, "_dump_fr_trace_json", lambda: json.dumps(gloo))
    monkeypatch.setattr(ops, "_dump_nccl_trace_json", lambda: json.dumps(nccl), raising=False)
    monkeypatch.setattr(dump.dist, "is_nccl_available", lambda: True)
    trace = dump._recorded_trace()
    assert [entry["profiling_name"] for entry in trace["entries"]] == ["nccl:all_reduce", "gloo:barrier",
                                                                         "nccl:all_gather"]
    assert trace["pg_config"] == nccl["pg_config"]
