"""RunSpec, what tests/support/train_worker.py runs: a misspelled key fails at once, at any level, and JSON carries
every field back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.support.run_spec import DataSpec, DrillSpec, RunSpec, TrainerSpec

pytestmark = pytest.mark.unit


def test_a_misspelled_key_fails_where_the_spec_is_built_and_where_the_worker_reads_it() -> None:
    misspelled: dict = {"steps": 2, "bacth_size": 4}
    with pytest.raises(TypeError, match="unexpected keyword argument 'bacth_size'"):
        RunSpec(**misspelled)
    text = json.dumps({**json.loads(RunSpec(steps=2, batch_size=4).to_json()), "validat": True})
    with pytest.raises(TypeError, match="unexpected keyword argument 'validat'"):
        RunSpec.from_json(text)
    # In a group too: where the spec is built, derived, and read.
    misspelled_in_a_group: dict = {"sq_len": 64}
    with pytest.raises(TypeError, match="unexpected keyword argument 'sq_len'"):
        DataSpec(**misspelled_in_a_group)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sq_len'"):
        RunSpec(steps=2, batch_size=4).with_(data=misspelled_in_a_group)
    nested = json.loads(RunSpec(steps=2, batch_size=4).to_json())
    nested["trainer"]["validat"] = True
    with pytest.raises(TypeError, match="unexpected keyword argument 'validat'"):
        RunSpec.from_json(json.dumps(nested))


def test_json_round_trips_and_is_canonical() -> None:
    spec = RunSpec(steps=6, batch_size=4, trainer=TrainerSpec(strategy={"tensor_parallel_size": 2, "compile": True},
                                                              clip=1.0),
                   drills=DrillSpec(kill_during_save={"rank": 1, "save": 2}))
    assert RunSpec.from_json(spec.to_json()) == spec
    reordered = RunSpec(steps=6, batch_size=4, drills=DrillSpec(kill_during_save={"save": 2, "rank": 1}),
                        trainer=TrainerSpec(clip=1.0, strategy={"compile": True, "tensor_parallel_size": 2}))
    assert reordered.to_json() == spec.to_json()  # the reference cache's key
    assert dataclasses.replace(spec, devices=2).to_json() != spec.to_json()
    assert spec.with_(data={"seq_len": 64}).to_json() != spec.to_json()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.steps = 7  # type: ignore[misc]  # frozen: a shared spec cannot change under another test
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.trainer.clip = 2.0  # type: ignore[misc]  # and so is each of its groups


def test_with_changes_only_the_fields_it_names() -> None:
    spec = RunSpec(steps=6, batch_size=4, data=DataSpec(seq_len=64, samples=24), trainer=TrainerSpec(clip=1.0))
    derived = spec.with_(batch_size=2, data={"samples": 48}, trainer=TrainerSpec(accumulate=2))
    assert derived == dataclasses.replace(spec, batch_size=2, data=DataSpec(seq_len=64, samples=48),
                                          trainer=TrainerSpec(accumulate=2))  # a group given whole replaces it
