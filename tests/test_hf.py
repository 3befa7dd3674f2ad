"""`titan-hf` export/import against Hugging Face transformers, and training from imported weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llama_module import Llama, LlamaConfig
from llama_module.hf import config_from_hf, hf_config
from llama_module.hf_cli import main as titan_hf
from tests.conftest import launch
from tests.support.parity import GLOBAL_BATCH, RTOL
from tests.support.run_spec import CheckpointSpec, RunSpec, TrainerSpec
from tests.support.train_worker import TINY, AffineSequences
from titan_strategy.checkpoint import read_hyper_parameters, read_model_weights

transformers = pytest.importorskip("transformers")


def _hf_model(directory: Path) -> Any:
    return transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()


def _llama_from(weights: dict[str, torch.Tensor], config: LlamaConfig) -> Llama:
    model = Llama(config)
    model.load_state_dict({name.removeprefix("model."): tensor for name, tensor in weights.items()})
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))


@pytest.mark.multiprocess
def test_export_of_a_sharded_checkpoint_gives_the_same_logits_in_transformers(tmp_path: Path,
                                                                             test_env: dict[str, str]) -> None:
    checkpoint = tmp_path / "step3.ckpt"
    spec = RunSpec(steps=3, batch_size=GLOBAL_BATCH // 2,
                   checkpoints=CheckpointSpec(save_at=3, save_path=str(checkpoint)),
                   trainer=TrainerSpec(strategy={"tensor_parallel_size": 2}))  # fsdp2 x tp2: every weight is sharded
    launch(4, spec, tmp_path / "run", test_env)
    titan_hf(["export", str(checkpoint), str(tmp_path / "hf"), "--dtype", "float32"])
    ours = _llama_from(read_model_weights(checkpoint), TINY)
    with torch.no_grad():
        torch.testing.assert_close(_hf_model(tmp_path / "hf")(_tokens()).logits, ours(_tokens()), rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        titan_hf(["export", str(checkpoint), str(tmp_path / "hf")])


@pytest.fixture
def hf_llama(tmp_path: Path) -> Path:
    """A random tiny LlamaForCausalLM with the test model's shape, saved as safetensors."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(TINY, torch_dtype="float32")))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)  # non-unit norms, so a swapped norm weight shows
    directory = tmp_path / "hf_in"
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.mark.multiprocess
def test_import_gives_the_same_logits_and_trains_from_them_under_fsdp_x_tp(hf_llama: Path, tmp_path: Path,
                                                                          test_env: dict[str, str]) -> None:
    checkpoint = tmp_path / "imported"
    titan_hf(["import", str(hf_llama), str(checkpoint)])
    assert read_hyper_parameters(checkpoint)["model"]["n_layers"] == TINY.n_layers
    ours = _llama_from(read_model_weights(checkpoint), TINY)
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens()), _hf_model(hf_llama)(_tokens()).logits, rtol=1e-5, atol=1e-5)
        # The first global batch: Lightning's DistributedSampler shuffles training data with seed 0.
        samples = AffineSequences(512, 32, TINY.vocab_size)
        first = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))[:GLOBAL_BATCH]
        batch = torch.utils.data.default_collate([samples[int(i)] for i in first])
        first_loss = torch.nn.functional.cross_entropy(ours(batch["input_ids"]).flatten(0, 1),
                                                       batch["labels"].flatten())
    # The first logged loss comes from the imported weights, sharded over fsdp2 x tp2.
    spec = RunSpec(steps=2, batch_size=GLOBAL_BATCH // 2,
                   trainer=TrainerSpec(strategy={"tensor_parallel_size": 2, "initial_weights": str(checkpoint)}))
    records = launch(4, spec, tmp_path / "run", test_env)
    assert records[0]["steps"][0]["train_loss"] == pytest.approx(float(first_loss), rel=RTOL)


@pytest.mark.unit
def test_bad_inputs_are_refused_clearly(hf_llama: Path, tmp_path: Path) -> None:
    from titan_strategy import TitanStrategy

    with pytest.raises(FileNotFoundError, match="is neither a complete TitanStrategy checkpoint"):
        TitanStrategy(initial_weights=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        titan_hf(["import", str(tmp_path), str(tmp_path / "out")])
    for weights in hf_llama.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights"):
        titan_hf(["import", str(hf_llama), str(tmp_path / "out")])
    tied = {**json.loads((hf_llama / "config.json").read_text()), "tie_word_embeddings": True}
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        config_from_hf(tied)


@pytest.mark.unit
def test_config_round_trips_through_config_json() -> None:
    for config in (TINY, LlamaConfig(**{**TINY.__dict__, "rope_scaling": None})):
        assert config_from_hf(hf_config(config)) == config
