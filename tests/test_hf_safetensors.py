"""load_safetensors and save_safetensors against transformers' own from_pretrained: every layout (FSDP2, TP, FSDP2
over TP, a pipeline stage's part) reads the weights from_pretrained reads, and what it saves loads back with the
same logits."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from tests.conftest import free_port
from titan_strategy.checkpoint.hf_safetensors import load_safetensors, save_safetensors

transformers = pytest.importorskip("transformers")

# Uneven under FSDP2 over TP (dp2 x tp2): 66 MLP rows are 33 per TP rank, then 17 and 16; 250 vocab rows 63 and 62.
LLAMA = {"vocab_size": 250, "hidden_size": 32, "intermediate_size": 66, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
# Tied, and uneven under FSDP2 on 2 ranks: 251 vocab rows are 126 and 125.
QWEN2 = {"vocab_size": 251, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
MLP_ROWS = "model.layers.0.mlp.gate_proj.weight"
_TP_PLAN = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
            **{f"model.layers.*.{name}": ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj",
                                                                         "self_attn.v_proj", "mlp.gate_proj",
                                                                         "mlp.up_proj")},
            **{f"model.layers.*.{name}": RowwiseParallel() for name in ("self_attn.o_proj", "mlp.down_proj")}}
# A pipeline stage's part: the modules the other stage holds are None.
_STAGE_LACKS = (("model.layers.1", "model.norm", "lm_head"), ("model.embed_tokens", "model.layers.0"))
NPROC = 4
SAVED = ("dp2xtp2", "tied_dp2", "pp2_dp2")


def _from_pretrained(directory: Path) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))


def _write_reference(config: Any, directory: Path) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random tiny models as ``save_pretrained`` writes them: an untied Llama and a tied Qwen2."""
    folder = tmp_path_factory.mktemp("references")
    return {"llama": _write_reference(transformers.LlamaConfig(**LLAMA), folder / "llama"),
            "qwen2": _write_reference(transformers.Qwen2Config(**QWEN2), folder / "qwen2")}


def _remove(model: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, None)


def _sharded(reference: Path, *, dp: DeviceMesh | None = None, tp: DeviceMesh | None = None,
             lacks: tuple[str, ...] = ()) -> nn.Module:
    """The reference's model built on the meta device, parallelized, given empty shards, then loaded."""
    config = transformers.AutoConfig.from_pretrained(reference)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _remove(model, lacks)
    if tp is not None:
        parallelize_module(model, tp, _TP_PLAN)
    if dp is not None:
        for layer in model.model.layers:
            if layer is not None:
                fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:
        model.tie_weights()  # to_empty gave the output projection a tensor of its own
    load_safetensors(model, reference)
    return model


def _compare(model: nn.Module, reference: Path) -> dict[str, Any]:
    """Which parameters differ from from_pretrained's (all gathered whole), and how the MLP rows were sharded."""
    expected = dict(_from_pretrained(reference).named_parameters())
    compared, mismatched = [], []
    for name, param in model.named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        compared.append(name)
        if not torch.equal(whole, expected[name]):
            mismatched.append(name)
    record: dict[str, Any] = {"compared": compared, "mismatched": mismatched}
    rows = dict(model.named_parameters()).get(MLP_ROWS)  # a pipeline stage may lack it
    if isinstance(rows, DTensor):
        record["mlp_placements"] = [type(placement).__name__ for placement in rows.placements]
        record["mlp_local_rows"] = rows.to_local().shape[0]
    return record


def _rank(rank: int, port: int, references: dict[str, Path], out: Path) -> None:
    """One rank: each layout loads its reference and compares it; three of them save. A failure leaves its
    traceback in ``rank{rank}.error`` (the launcher reports only the first rank to end, often a bystander)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # forked before the tests' own setting: module fixtures come first
    try:
        _run_rank(rank, port, references, out)
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _run_rank(rank: int, port: int, references: dict[str, Path], out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NPROC,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        stages = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        models = {"dp2": (_sharded(references["llama"], dp=mesh["dp"]), "llama"),
                  "tp2": (_sharded(references["llama"], tp=mesh["tp"]), "llama"),
                  "dp2xtp2": (_sharded(references["llama"], dp=mesh["dp"], tp=mesh["tp"]), "llama"),
                  "tied_dp2": (_sharded(references["qwen2"], dp=mesh["dp"]), "qwen2"),
                  "pp2_dp2": (_sharded(references["llama"], dp=stages["dp"],
                                       lacks=_STAGE_LACKS[stages.get_local_rank("pp")]), "llama")}
        records = {case: _compare(model, references[kind]) for case, (model, kind) in models.items()}
        tied = models["tied_dp2"][0]
        records["tied_dp2"]["tied"] = tied.lm_head.weight is tied.model.embed_tokens.weight
        for case in SAVED:
            save_safetensors(models[case][0], out / case, max_shard_bytes=40_000)  # several files
        (out / f"rank{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(references: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Every layout, in one launch of 4 forked gloo ranks (a hung collective fails at the 60 s group timeout)."""
    out = tmp_path_factory.mktemp("launched")
    try:
        mp.start_processes(_rank, args=(free_port(), references, out), nprocs=NPROC, start_method="fork")
    except mp.ProcessRaisedException:
        errors = "".join(f"\n--- {path.stem}:\n{path.read_text()}" for path in sorted(out.glob("rank*.error")))
        raise AssertionError(f"a rank failed; the errors of those that did:{errors}") from None
    return out, [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(NPROC)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["dp2", "tp2", "dp2xtp2", "tied_dp2"])
def test_every_layout_loads_what_from_pretrained_loads(case: str, launched: tuple[Path, list[dict]],
                                                       references: dict[str, Path]) -> None:
    kind = "qwen2" if case == "tied_dp2" else "llama"
    names = [name for name, _ in _from_pretrained(references[kind]).named_parameters()]
    for record in launched[1]:
        assert record[case]["compared"] == names
        assert record[case]["mismatched"] == []
        assert record[case].get("tied", True)  # the tied model's output projection is still its embedding


@pytest.mark.multiprocess
def test_fsdp_over_tp_loads_uneven_strided_shards(launched: tuple[Path, list[dict]]) -> None:
    records = [record["dp2xtp2"] for record in launched[1]]
    assert {tuple(record["mlp_placements"]) for record in records} == {("_StridedShard", "Shard")}
    assert sorted(record["mlp_local_rows"] for record in records) == [16, 16, 17, 17]  # 66 rows: 33, 33 by TP


@pytest.mark.multiprocess
def test_a_pipeline_stage_loads_what_it_holds(launched: tuple[Path, list[dict]], references: dict[str, Path]) -> None:
    names = [name for name, _ in _from_pretrained(references["llama"]).named_parameters()]
    held = [set(record["pp2_dp2"]["compared"]) for record in launched[1]]
    assert all(record["pp2_dp2"]["mismatched"] == [] for record in launched[1])
    assert held[0] == held[1] and held[2] == held[3]  # ranks 0, 1 are stage 0; 2, 3 stage 1
    assert held[0].isdisjoint(held[2]) and held[0] | held[2] == set(names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", SAVED)
def test_a_saved_model_loads_in_transformers_with_the_same_logits(case: str, launched: tuple[Path, list[dict]],
                                                                  references: dict[str, Path]) -> None:
    saved = launched[0] / case
    kind = "qwen2" if case == "tied_dp2" else "llama"
    original, loaded = _from_pretrained(references[kind]), _from_pretrained(saved)
    tokens = _tokens(original.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, original(tokens).logits, rtol=0, atol=0)
    weight_map = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == sorted(load_file(references[kind] / "model.safetensors"))  # each once, as HF names
    assert len(set(weight_map.values())) > 1
    assert not (launched[0] / f".{case}.incomplete").exists()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.unit
def test_one_process_saves_one_file_and_loads_into_a_meta_built_model(references: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    original = _from_pretrained(references["qwen2"])
    save_safetensors(original, tmp_path / "saved")
    assert sorted(path.name for path in (tmp_path / "saved").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as saved:
        assert "lm_head.weight" not in list(saved.keys()) and saved.metadata() == {"format": "pt"}
    loaded = _sharded(tmp_path / "saved")
    for name, param in original.named_parameters():
        assert torch.equal(loaded.get_parameter(name), param), name


@pytest.mark.unit
def test_weights_of_another_dtype_are_converted(references: dict[str, Path], tmp_path: Path) -> None:
    in_bf16 = _from_pretrained(references["llama"]).to(torch.bfloat16)
    in_bf16.save_pretrained(tmp_path / "bf16")
    loaded = _sharded(tmp_path / "bf16")
    for name, param in in_bf16.named_parameters():
        assert loaded.get_parameter(name).dtype == torch.float32
        assert torch.equal(loaded.get_parameter(name), param.float()), name


def _lacking_a_key(reference: Path, directory: Path) -> Path:
    directory.mkdir()
    weights = load_file(reference / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _empty(reference: Path, directory: Path) -> Path:
    directory.mkdir()
    return directory


@pytest.mark.unit
@pytest.mark.parametrize(("model_config", "directory_from", "error", "message"), [
    ({}, _lacking_a_key, ValueError, r"lacks 1 tensors of the model: \['model.layers.1.mlp.down_proj.weight'\]"),
    ({"intermediate_size": 64}, lambda reference, directory: reference, ValueError,
     r"model.layers.0.mlp.gate_proj.weight: \(66, 32\) in the files, \(64, 32\) in the model"),
    ({}, _empty, FileNotFoundError, "holds no safetensors weights"),
])
def test_a_bad_directory_is_refused_before_the_model_is_written(model_config: dict, directory_from: Any,
                                                                  error: type[Exception], message: str,
                                                                  references: dict[str, Path], tmp_path: Path) -> None:
    directory = directory_from(references["llama"], tmp_path / "bad")
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **model_config}))
    before = _snapshot(model)
    with pytest.raises(error, match=message) as refused:
        load_safetensors(model, directory)
    assert str(directory) in str(refused.value)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.unit
def test_a_non_empty_target_is_refused_and_left_alone(references: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=f"{target} exists and is not empty"):
        save_safetensors(_from_pretrained(references["llama"]), target)
    assert [path.name for path in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["target"]


@pytest.mark.unit
def test_a_strided_shard_of_another_form_is_refused(tmp_path: Path) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (1, 1))
        model = nn.Linear(2, 4)
        model.weight = nn.Parameter(DTensor.from_local(torch.zeros(4, 2), mesh,
                                                       [_StridedShard(0, split_factor=2), Replicate()]))
        save_file({"weight": torch.ones(4, 2), "bias": torch.ones(4)}, tmp_path / "model.safetensors")
        with pytest.raises(NotImplementedError, match=r"weight is laid out as .*_StridedShard"):
            load_safetensors(model, tmp_path)
    finally:
        dist.destroy_process_group()

