"""TitanStrategy's construction-time behaviour: bad input fails before any process or file exists."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

from titan_strategy import PIPELINE_SCHEDULES, TitanStrategy
from titan_strategy.precision import TitanPrecision

pytestmark = pytest.mark.unit


def _trainer(tmp_path: Path, strategy: TitanStrategy | str, devices: int = 2, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, default_root_dir=str(tmp_path), **kwargs)


@pytest.mark.parametrize(("strategy", "devices", "message"), [
    (TitanStrategy(tensor_parallel_size=3), 2, r"world size 2 is not divisible by .*tensor_parallel_size=3"),
    (TitanStrategy(data_parallel_shard_size=2, tensor_parallel_size=2), 2,
     r"multiply to .* = 4, but the world size is 2"),
    (TitanStrategy(data_parallel_replicate_size=3), 4, r"world size 4 is not divisible"),
])
def test_bad_layout_fails_in_trainer_init_without_launching_or_writing(strategy: TitanStrategy, devices: int,
                                                                        message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, strategy, devices=devices)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pipeline_schedule": "Zigzag"}, r"pipeline_schedule='Zigzag' must be one of \['GPipe', '1F1B'"),
    ({"pipeline_microbatches": 0}, r"pipeline_microbatches=0 must be a positive integer"),
    ({"pipeline_stages_per_rank": 3, "pipeline_schedule": "ZBVZeroBubble"},
     r"pipeline_schedule='ZBVZeroBubble' places exactly 2 stages per rank in a V, but pipeline_stages_per_rank=3"),
    ({"pipeline_stages_per_rank": 2, "pipeline_schedule": "1F1B"},
     r"pipeline_schedule='1F1B' runs one stage per rank, but pipeline_stages_per_rank=2; use 1, or a multi-stage"),
    ({"pipeline_layers_per_stage": 2, "pipeline_split_points": [2]},
     r"Set pipeline_layers_per_stage or pipeline_split"),
    ({"pipeline_split_points": [4, 2]}, r"pipeline_split_points=\[4, 2\] must be strictly increasing"),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "DualPipeV", "compile": True},
     r"pipeline_schedule='DualPipeV' splits backward .* refuses for compiled stages; use compile=False"),
    ({"fsdp_reshard_after_forward": "sometimes"}, r"fsdp_reshard_after_forward='sometimes' must be one of"),
    ({"timeout_seconds": 0}, r"timeout_seconds=0 must be > 0"),
    ({"context_parallel_rotate_method": "ring"},
     r"context_parallel_rotate_method='ring' must be one of \['allgather', "),
    ({"activation_checkpointing": "some"},
     r"activation_checkpointing='some' must be one of \['none', 'full', 'selective_op', 'selective_layer'\]"),
    ({"activation_checkpointing": "selective_layer", "activation_checkpointing_every": 0},
     r"activation_checkpointing_every=0 must be >= 1"),
    ({"float8": "blockwise"}, r"float8='blockwise' must be one of \['none', 'tensorwise', 'rowwise'\]"),
    ({"save_distributed_checkpoint": "false"}, r"save_distributed_checkpoint='false' must be True \(sharded folders\)"),
])
def test_bad_knobs_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TitanStrategy(**kwargs)


def test_every_documented_schedule_is_accepted() -> None:
    for schedule in PIPELINE_SCHEDULES:
        assert TitanStrategy(pipeline_schedule=schedule).config.pipeline.schedule == schedule


@pytest.mark.parametrize(("precision", "expected"), [("32-true", None), ("bf16-mixed", "bfloat16")])
def test_trainer_precision_maps_to_fsdp_mixed_precision(precision: str, expected: str | None, tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, TitanStrategy(), precision=precision)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, TitanPrecision)
    assert (str(plugin.param_dtype).removeprefix("torch.") if plugin.param_dtype else None) == expected
    assert plugin.reduce_dtype is None or str(plugin.reduce_dtype) == "torch.float32"


@pytest.mark.parametrize("precision", ["64-true"])
def test_unsupported_precision_is_refused_with_the_alternatives(precision: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"does not support precision='{precision}'.*'32-true', 'bf16-mixed'"):
        _trainer(tmp_path, TitanStrategy(), precision=precision)


def test_registered_name_gives_the_contract_defaults(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "titan", devices=4)
    strategy = trainer.strategy
    assert isinstance(strategy, TitanStrategy)
    dims = strategy.parallel_dims
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp) == (1, 4, 1, 1, 1)
    assert strategy.config.pipeline.schedule == "1F1B" and strategy.is_distributed


def test_float8_is_refused_on_cpu_in_trainer_init(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"float8='tensorwise' needs an NVIDIA GPU of compute capability >= 8.9.*"
                                         r"run is on cpu; use float8='none'"):
        _trainer(tmp_path, TitanStrategy(float8="tensorwise"))
    assert list(tmp_path.iterdir()) == []


def test_compile_loss_needs_a_compute_loss_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    def no_launch(self: _SubprocessScriptLauncher) -> None:
        # A started rank re-runs this pytest command line: the whole suite, beside this one.
        raise AssertionError("the other processes were started before the module was checked")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", no_launch)
    trainer = _trainer(tmp_path, TitanStrategy(compile_loss=True), max_steps=1)
    with pytest.raises(ValueError, match=r"compile_loss=True compiles the module's compute_loss\(output, target\), "
                                         r"but BoringModel has none"):
        trainer.fit(BoringModel())
    assert list(tmp_path.iterdir()) == []


def test_the_progress_bar_takes_the_loss_only_on_logging_steps(tmp_path: Path) -> None:
    # Lightning converts progress-bar values to Python numbers each step they are logged (a host sync on GPU);
    # the loss reaches the bar only every log_every_n_steps, and the loggers' callback metrics every step.
    from torch.utils.data import DataLoader

    from llama_module import LlamaModule
    from tests.support.train_worker import TINY, AffineSequences

    seen: list[tuple[float, float]] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            seen.append((trainer.progress_bar_metrics["loss"], float(trainer.callback_metrics["train_loss"])))

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, log_every_n_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record()], default_root_dir=tmp_path)
    trainer.fit(LlamaModule(model=TINY, warmup_steps=1, decay_steps=10),
                DataLoader(AffineSequences(64, 32, TINY.vocab_size), batch_size=2))
    bar, losses = zip(*seen)
    assert len(set(losses)) == 7  # every step's loss reached the callback metrics
    # Steps 0, 3 and 6 (global_step at their training_step) refreshed the bar, with that step's loss.
    assert list(bar) == [losses[0]] * 3 + [losses[3]] * 3 + [losses[6]]


def test_a_single_device_trains_without_fsdp_under_autocast(tmp_path: Path) -> None:
    # FSDP on one device has nothing to shard and would only copy weights and gradients through its buffers;
    # there the fp32 weights stay plain parameters and bf16-mixed comes from autocast.
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.data import DataLoader

    from llama_module import LlamaModule
    from tests.support.train_worker import TINY, AffineSequences

    logits_dtypes: list[torch.dtype] = []

    class Record(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            pl_module.model.output.register_forward_hook(lambda _, __, out: logits_dtypes.append(out.dtype))

    module = LlamaModule(model=TINY, warmup_steps=1, decay_steps=10, cross_entropy="logits")  # the output's logits
    trainer = _trainer(tmp_path, TitanStrategy(), devices=1, precision="bf16-mixed", max_steps=2, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[Record()])
    trainer.fit(module, DataLoader(AffineSequences(16, 32, TINY.vocab_size), batch_size=2))
    assert not any(isinstance(m, FSDPModule) for m in module.modules())
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in module.parameters())
    assert logits_dtypes == [torch.bfloat16] * 2


def test_a_checkpoint_path_of_neither_form_is_refused_saying_what_it_is(tmp_path: Path) -> None:
    import torch
    from torch import nn

    from titan_strategy.checkpoint import RankPlace, load_checkpoint
    from titan_strategy.checkpoint.single_file import load_single_file

    model = nn.Linear(2, 2)
    unsafe = tmp_path / "unsafe.ckpt"  # a Path in the hyper-parameters: unpickling it runs code
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": {"data": tmp_path}}, unsafe)
    with pytest.raises(ValueError, match=r"holds more than tensors and plain containers .* If you trust the file, "
                                         r"pass weights_only=False"):
        load_single_file(unsafe, model, [], strict=True, weights_only=None)
    assert load_single_file(unsafe, model, [], strict=True, weights_only=False)["hyper_parameters"]
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match=r"list.pt is a file but not a Lightning checkpoint: it has no 'state_dict'"):
        load_single_file(tmp_path / "list.pt", model, [], strict=True, weights_only=None)
    torch.save({"state_dict": {"weight": torch.zeros(2, 2)}}, tmp_path / "partial.ckpt")
    with pytest.raises(KeyError, match=r"missing \['bias'\], unexpected \[\]"):
        load_single_file(tmp_path / "partial.ckpt", model, [], strict=True, weights_only=None)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("")
    place = RankPlace(rank=0, world_size=1, batch_rank=0, batch_world_size=1)
    with pytest.raises(FileNotFoundError, match=r"it is a folder of \['notes.txt'\] with no titan_checkpoint.json"):
        load_checkpoint(tmp_path / "folder", model, [], place, strict=True, weights_only=None, group=None)


def test_a_plain_modules_blocks_are_found_without_the_user() -> None:
    import torch
    from torch import nn

    from titan_strategy.parallelize.blocks import repeated_blocks

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))  # inside a block: not blocks of their own

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 2)
            self.layers = nn.ModuleList(Block() for _ in range(3))
            self.mixed = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # two classes: not repeated blocks
            self.acts = nn.ModuleList(nn.ReLU() for _ in range(2))  # no parameters
            self.heads = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})

    assert repeated_blocks(Net()) == ("layers.0", "layers.1", "layers.2", "heads.a", "heads.b")
    transformers = pytest.importorskip("transformers")
    from tests.support.user_modules import HF_SHAPE

    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE))
    # _no_split_modules: LlamaDecoderLayer
    assert repeated_blocks(llama) == tuple(f"model.layers.{i}" for i in range(HF_SHAPE["num_hidden_layers"]))


def test_a_meta_built_module_without_an_initializer_is_named_before_any_allocation() -> None:
    import torch
    from torch import nn

    from titan_strategy.parallelize.materialize import own_initializers

    class Scale(nn.Module):  # a parameter, and neither reset_parameters() nor a transformers model around it
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(2, 2), Scale())
    with pytest.raises(TypeError, match=r"Modules \['1 \(Scale\)'\] were built on the meta device .* define no "
                                        r"reset_parameters\(\) and are not part of a transformers PreTrainedModel"):
        own_initializers(net)
    # Inside a transformers model, whose _init_weights does not know it: nothing writes it, and that is refused.
    transformers = pytest.importorskip("transformers")
    from tests.support.user_modules import HF_SHAPE
    from titan_strategy.parallelize.materialize import materialize_with_own_initializers

    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE))
        llama.model.scale = Scale()
    with pytest.raises(TypeError, match=r"\['Scale.weight'\] were built on the meta device and no initializer wrote"):
        materialize_with_own_initializers(llama, torch.device("cpu"))
