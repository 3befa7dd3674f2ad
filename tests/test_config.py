"""The flat TitanStrategy knobs, their YAML form and the feature configs are one thing: written once, checked once."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import pytest
import yaml

from titan_strategy import TitanStrategy
from titan_strategy.config import PLUGIN_ARGUMENTS, TitanConfig, knob_names
from titan_strategy.config.activation_checkpoint import ActivationCheckpointConfig
from titan_strategy.config.pipeline import PipelineConfig
from titan_strategy.knobs import KNOB, choices

pytestmark = pytest.mark.unit

# Every knob away from its default (two sets: compile and TP > 1 cannot meet on torch 2.13).
TP_HEAVY = {
    "data_parallel_replicate_size": 2, "data_parallel_shard_size": 2, "tensor_parallel_size": 2,
    "context_parallel_size": 2, "context_parallel_rotate_method": "alltoall", "pipeline_parallel_size": 2,
    "pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 4, "pipeline_stages_per_rank": 2,
    "pipeline_split_points": [1, 2, 3], "fsdp_reshard_after_forward": "always", "sequence_parallel": False,
    "loss_parallel": False, "activation_checkpointing": "selective_layer", "activation_checkpointing_every": 3,
    "float8": "rowwise", "process_group_backend": "gloo", "timeout_seconds": 60.0, "checkpoint_mode": "async",
    "auto_resume": True, "flight_recorder": True,
}
COMPILED = {"compile": True, "compile_loss": True, "async_tensor_parallel": True, "pipeline_layers_per_stage": 2,
            "pipeline_parallel_size": 2, "pipeline_schedule": "LoopedBFS", "activation_checkpointing": "full"}


def _signature() -> dict[str, inspect.Parameter]:
    return {name: parameter for name, parameter in inspect.signature(TitanStrategy).parameters.items()
            if name not in PLUGIN_ARGUMENTS}


def _from_yaml(knobs: dict[str, Any]) -> TitanStrategy:
    """``trainer.strategy`` of a ``titan fit`` YAML, parsed and instantiated by jsonargparse as LightningCLI does."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(TitanStrategy, "strategy")
    text = yaml.safe_dump({"strategy": {"class_path": "titan_strategy.TitanStrategy", "init_args": knobs}})
    return parser.instantiate_classes(parser.parse_string(text)).strategy


def test_every_signature_argument_is_one_feature_field_with_the_same_default() -> None:
    signature = _signature()
    assert sorted(signature) == sorted(knob_names())
    defaults = TitanConfig().knobs()
    assert {name: parameter.default for name, parameter in signature.items()} == defaults


def test_a_literal_knob_takes_its_allowed_values_from_the_feature_field() -> None:
    hints = typing.get_type_hints(TitanStrategy.__init__)
    literal_knobs = {name for name in _signature() if choices(hints[name])}
    assert {"pipeline_schedule", "float8", "activation_checkpointing", "checkpoint_mode",
            "fsdp_reshard_after_forward", "context_parallel_rotate_method"} <= literal_knobs
    config = TitanConfig()
    for feature in dataclasses.fields(config):
        for field in dataclasses.fields(getattr(config, feature.name)):
            name = field.metadata.get(KNOB)  # the pipeline's degree is the mesh's knob
            if name in literal_knobs:  # the same Literal object, not a copy of its values
                assert typing.get_type_hints(type(getattr(config, feature.name)))[field.name] is hints[name]


@pytest.mark.parametrize("knobs", [TP_HEAVY, COMPILED], ids=["tp-heavy", "compiled"])
def test_flat_kwargs_yaml_and_feature_objects_agree(knobs: dict[str, Any]) -> None:
    config = TitanConfig.from_knobs(**knobs)
    assert TitanStrategy(**knobs).config == config == _from_yaml(knobs).config
    assert TitanConfig.from_knobs(**config.knobs()) == config
    flat = config.knobs()
    assert {name: flat[name] for name in knobs} == {name: tuple(v) if isinstance(v, list) else v
                                                    for name, v in knobs.items()}
    if knobs is TP_HEAVY:
        assert config.activation_checkpointing == ActivationCheckpointConfig(mode="selective_layer", every=3)
        assert config.pipeline == PipelineConfig(size=2, schedule="Interleaved1F1B", microbatches=4,
                                                 stages_per_rank=2, split_points=(1, 2, 3))
        assert (config.mesh.tp, config.tensor_parallel.loss_parallel, config.float8.recipe) == (2, False, "rowwise")


@pytest.mark.parametrize("knob", ["pipeline_schedule", "float8", "activation_checkpointing", "checkpoint_mode",
                                  "fsdp_reshard_after_forward", "context_parallel_rotate_method"])
def test_a_bad_choice_names_the_value_and_every_allowed_one(knob: str) -> None:
    allowed = choices(typing.get_type_hints(TitanStrategy.__init__)[knob])
    with pytest.raises(ValueError, match=rf"{knob}='bogus' must be one of") as raised:
        TitanStrategy(**{knob: "bogus"})
    assert str(list(allowed)) in str(raised.value)


def test_an_unknown_knob_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"TitanStrategy has no knob \['tensor_paralel_size'\]"):
        TitanConfig.from_knobs(tensor_paralel_size=2)


def test_pipeline_with_manual_optimization_fails_before_any_process_starts(tmp_path: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning as L
    from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    def no_launch(self: _SubprocessScriptLauncher) -> None:
        raise AssertionError("the other processes were started before the module was checked")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", no_launch)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(pipeline_parallel_size=2), max_steps=1,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 runs forward and backward inside the pipeline "
                                         r"schedule, which needs Lightning's automatic optimization"):
        trainer.fit(ManualOptimBoringModel())
    assert list(tmp_path.iterdir()) == []
