"""RunSpec, what tests/train_worker.py runs: a misspelled key fails at once, and JSON carries every field back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.run_spec import RunSpec

pytestmark = pytest.mark.unit


def test_a_misspelled_key_fails_where_the_spec_is_built_and_where_the_worker_reads_it() -> None:
    misspelled: dict = {"steps": 2, "bacth_size": 4}
    with pytest.raises(TypeError, match="unexpected keyword argument 'bacth_size'"):
        RunSpec(**misspelled)
    text = json.dumps({**json.loads(RunSpec(steps=2, batch_size=4).to_json()), "validat": True})
    with pytest.raises(TypeError, match="unexpected keyword argument 'validat'"):
        RunSpec.from_json(text)


def test_json_round_trips_and_is_canonical() -> None:
    spec = RunSpec(steps=6, batch_size=4, strategy={"tensor_parallel_size": 2, "compile": True}, clip=1.0,
                   kill_during_save={"rank": 1, "save": 2})
    assert RunSpec.from_json(spec.to_json()) == spec
    reordered = RunSpec(steps=6, batch_size=4, strategy={"compile": True, "tensor_parallel_size": 2}, clip=1.0,
                        kill_during_save={"save": 2, "rank": 1})
    assert reordered.to_json() == spec.to_json()  # the reference cache's key
    assert dataclasses.replace(spec, devices=2).to_json() != spec.to_json()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.steps = 7  # type: ignore[misc]  # frozen: a shared spec cannot change under another test
