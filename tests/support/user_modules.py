"""Training runs of modules nobody here wrote (a plain ``nn.Module`` LightningModule, Lightning's ``BoringModel``,
tiny transformers causal LMs), under TitanStrategy or Lightning's DDP: ``RunSpec.model.user_module`` picks one, and
tests/support/train_worker.py hands such a spec to ``main`` here.

``user_module`` keys (all but ``kind`` optional):
    kind: "mlp" (an ``nn.Module`` stack in a ModuleList), "boring" (Lightning's BoringModel), or one of
        ``HF_KINDS`` (``hf_model``), fed transformers-style labels (``NextTokenLabels``); "causal_lm" is
        ``llama_module.CausalLM``, fed next-token labels as ``TextDataModule`` gives them;
        "tiny_llama" is this project's LlamaModule (it declares a plan), for checkpoints exchanged with DDP.
    build: "init" (in ``__init__``), "configure_model", or "init_module" (``__init__`` under
        ``trainer.init_module(empty_init=False)``, every weight then filled with 0.5); for "mlp", "shard_one_block"
        (``configure_model`` shards its first block over ``device_mesh["data_parallel"]`` and nothing else) or
        "manual" (manual optimization: backward and step inside ``training_step``).
    pretrained: a transformers model folder that ``__init__`` loads with ``from_pretrained`` ("causal_lm":
        ``CausalLM(pretrained=...)``, which reads each rank's shards after sharding).
    save_hf: a folder the trained transformers model is saved to (``save_safetensors``) after fit.
    strategy: "titan" (``RunSpec.trainer.strategy`` its arguments) or "ddp".
    swa: add ``StochasticWeightAveraging``; barebones: ``Trainer(barebones=True)``; log_every_n_steps: the Trainer's.
    save_distributed_checkpoint: TitanStrategy's.
    validate_from: ``trainer.validate`` from this checkpoint instead of fit; the record's ``validated`` holds its
        metrics.
``RunSpec.checkpoints.save_at``/``save_path``: ``trainer.save_checkpoint`` after that step.

Each rank's record: ``losses`` (each step's loss, averaged over the data-parallel ranks), ``weights_at_start`` and
``weights`` (each parameter's full sum and sum of squares at ``on_train_start`` and after fit), ``numels``,
``local_numel`` (the elements of this rank's parameter shards), ``seen_seq_len`` (the sequence length a training step
saw), ``param_dtypes``,
``warnings`` (TitanStrategy's about plain means of padded labels). ``RunSpec.data.padded_labels`` pads the labels.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.support.run_spec import RunSpec
from titan_strategy import TitanStrategy

VOCAB = 256
HF_SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


HF_KINDS = ("llama", "qwen2", "qwen2_tied", "qwen3", "mistral", "gemma2", "phi3")


def hf_config(kind: str) -> Any:
    """The tiny transformers config of ``kind``: "llama", "qwen2" (q/k/v biases), "qwen2_tied" (its output
    projection is its token embedding, as in the small Qwen2 models), "qwen3" (per-head q/k norms), "mistral"
    (a sliding window, longer than the test sequences), "gemma2" (tied, scaled embeddings, soft-capped logits) or
    "phi3" (fused q/k/v and gate/up projections)."""
    import transformers

    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen2_tied": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
              "mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config,
              "phi3": transformers.Phi3Config}[kind]
    extra = {"qwen2": {"tie_word_embeddings": False}, "qwen2_tied": {"tie_word_embeddings": True},
             "qwen3": {"tie_word_embeddings": False}, "gemma2": {"head_dim": 8},
             "phi3": {"pad_token_id": None}}.get(kind, {})
    return config(**HF_SHAPE, **extra)


def hf_model(kind: str) -> nn.Module:
    """A random tiny transformers causal LM of ``kind`` (``hf_config``), on the current default device."""
    import transformers

    return transformers.AutoModelForCausalLM.from_config(hf_config(kind))


class NextTokenLabels(torch.utils.data.Dataset):
    """AffineSequences with labels in transformers' convention: each position's own token (the model shifts them),
    -100 where AffineSequences' next-token labels are -100 (the first position keeps its token)."""

    def __init__(self, samples: torch.utils.data.Dataset) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        labels = torch.cat([sample["input_ids"][:1], sample["labels"][:-1]])
        return {**sample, "labels": labels}


class CausalLM(L.LightningModule):
    """A user's LightningModule around a transformers causal LM: built in ``__init__`` (random or
    ``from_pretrained``) or in ``configure_model``; the loss is transformers' own (labels shifted inside)."""

    def __init__(self, kind: str, build: str, pretrained: str | None = None, log: bool = True) -> None:
        super().__init__()
        self.kind, self.build, self.pretrained, self.logs = kind, build, pretrained, log
        self.model: nn.Module | None = None
        if pretrained is not None:
            import transformers

            self.model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
        elif build != "configure_model":
            self.model = hf_model(kind)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = hf_model(self.kind)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen_seq_len = batch["input_ids"].shape[1]  # 1/cp of the sequence under context parallelism
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        if self.logs:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class MLP(L.LightningModule):
    """A DDP-style module: an embedding, a ModuleList of identical blocks and a head, all built in ``__init__``;
    regression on AffineSequences' tokens as floats."""

    def __init__(self, shard_one_block: bool = False, manual: bool = False) -> None:
        super().__init__()
        self.shard_one_block = shard_one_block
        self.automatic_optimization = not manual
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 1)

    def configure_model(self) -> None:
        if self.shard_one_block:  # a ModelParallelStrategy-style module that forgot the rest
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.blocks[0], mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).squeeze(-1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features = batch["input_ids"][:, :8].float() / VOCAB
        loss = nn.functional.mse_loss(self(features), batch["labels"][:, 8].float() / VOCAB)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Boring(BoringModel):
    """Lightning's BoringModel, fed AffineSequences' tokens as floats."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return super().training_step(batch["input_ids"].float() / VOCAB, batch_idx)


def weight_sums(module: nn.Module) -> dict[str, list[float]]:
    """Each parameter's full sum and sum of squares (in float64); a collective where parameters are sharded."""
    sums = {}
    for name, param in module.named_parameters():
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach().double()
        sums[name] = [float(full.sum()), float(full.square().sum())]
    return sums


def assert_same_weights(record: dict[str, Any], reference: dict[str, Any], rtol: float = 1e-5) -> None:
    """Every parameter the record holds ends as the reference's, each element within ``rtol`` of its size: its sum
    within ``rtol`` x the sum of its elements' sizes (at most sqrt(numel x sum of squares); a sum alone cancels,
    and would compare rounding), its sum of squares within 2 ``rtol`` of itself. A key's bias is skipped: softmax
    ignores what it adds to all of a query's scores, so its gradient is rounding noise, which Adam turns into
    full-size steps that differ with the summation order."""
    for name, (total, squares) in record["weights"].items():
        if name.endswith("k_proj.bias"):
            continue
        ref_total, ref_squares = reference["weights"][name]
        assert abs(total - ref_total) <= rtol * math.sqrt(reference["numels"][name] * ref_squares) + 1e-12, name
        assert squares == pytest.approx(ref_squares, rel=2 * rtol, abs=1e-12), name


class Recorder(Callback):
    def __init__(self, save_at: int | None, save_path: str | None) -> None:
        self.losses: list[float] = []
        self.weights_at_start: dict[str, list[float]] = {}
        self.local_numel = 0
        self.mesh: dict[str, Any] = {}
        self.save_at, self.save_path = save_at, save_path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights_at_start = weight_sums(pl_module)
        self.local_numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in pl_module.parameters())
        if isinstance(trainer.strategy, TitanStrategy):  # what code written for ModelParallelStrategy relies on
            mesh = pl_module.device_mesh
            self.mesh = {"is_device_mesh": isinstance(mesh, DeviceMesh), "names": list(mesh.mesh_dim_names),
                         "views": {name: mesh[name].size() for name in ("data_parallel", "tensor_parallel", "batch",
                                                                        "loss", "dp_shard_cp")},
                         "deep_copied": copy.deepcopy(mesh)["batch"].size(),
                         "unpickled": pickle.loads(pickle.dumps(mesh))["data_parallel"].size()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = (outputs["loss"] if isinstance(outputs, dict) else outputs).detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(float(loss))
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.save_path)


def _module(options: dict[str, Any], trainer: L.Trainer) -> L.LightningModule:
    kind, build = options["kind"], options.get("build", "init")
    if kind == "mlp":
        return MLP(shard_one_block=build == "shard_one_block", manual=build == "manual")
    if kind == "boring":
        return Boring()
    if kind == "tiny_llama":
        from llama_module import LlamaModule
        from tests.support.train_worker import TINY

        return LlamaModule(model=TINY, warmup_steps=2, decay_steps=100, cross_entropy="logits")
    if kind == "causal_lm":  # this project's CausalLM: a transformers directory, or a config on the meta device
        from llama_module import CausalLM as OurCausalLM

        config = None if options.get("pretrained") else {**hf_config("llama").to_dict(), "model_type": "llama"}
        return OurCausalLM(pretrained=options.get("pretrained"), config=config, lr=3e-3, betas=(0.9, 0.999),
                        weight_decay=0.01, warmup_steps=0, decay_steps=1000, min_lr_ratio=1.0)
    if build == "init_module":
        with trainer.init_module(empty_init=False):
            module = CausalLM(kind, "init", log=not options.get("barebones", False))
        with torch.no_grad():
            for param in module.parameters():
                param.fill_(0.5)
        return module
    return CausalLM(kind, build, options.get("pretrained"), log=not options.get("barebones", False))


def main(spec: RunSpec, out_dir: Path) -> None:
    options = spec.model.user_module
    assert options is not None
    L.seed_everything(spec.seed, verbose=False)
    if options.get("strategy", "titan") == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = TitanStrategy(**spec.trainer.strategy, timeout_seconds=spec.trainer.timeout_seconds,
                                 save_distributed_checkpoint=options.get("save_distributed_checkpoint", True))
    recorder = Recorder(spec.checkpoints.save_at, spec.checkpoints.save_path)
    callbacks: list[Callback] = [recorder]
    if options.get("swa"):
        callbacks.append(StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1))
    barebones = options.get("barebones", False)
    trainer = L.Trainer(accelerator=spec.accelerator, devices=spec.devices, strategy=strategy,
                        precision=spec.trainer.precision, max_steps=spec.steps, callbacks=callbacks,
                        barebones=barebones,
                        log_every_n_steps=options.get("log_every_n_steps"),
                        **({} if barebones else {"logger": False, "enable_checkpointing": False,
                                                 "enable_progress_bar": False, "enable_model_summary": False}),
                        num_sanity_val_steps=0, limit_val_batches=2 if options.get("validate_from") else 0,
                        default_root_dir=str(out_dir))
    module = _module(options, trainer)
    from tests.support.train_worker import AffineSequences

    samples: Any = AffineSequences(spec.data.samples, spec.data.seq_len, VOCAB, padded=spec.data.padded_labels)
    if options["kind"] in HF_KINDS:  # transformers shifts the labels itself
        samples = NextTokenLabels(samples)
    loader = DataLoader(samples, batch_size=spec.batch_size)
    if options.get("validate_from"):
        [validated] = trainer.validate(module, loader, ckpt_path=options["validate_from"], verbose=False)
        (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps({"validated": validated}))
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader, ckpt_path=spec.checkpoints.resume_from)
    record = {"warnings": [str(warning.message) for warning in caught if "plain mean" in str(warning.message)],
              "losses": recorder.losses, "weights_at_start": recorder.weights_at_start,
              "weights": weight_sums(module), "numels": {name: p.numel() for name, p in module.named_parameters()},
              "local_numel": recorder.local_numel, "seen_seq_len": getattr(module, "seen_seq_len", None),
              "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
              "global_step": trainer.global_step, "mesh": recorder.mesh}
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    if options.get("save_hf"):
        from titan_strategy.checkpoint.hf_safetensors import save_safetensors

        save_safetensors(module.model, Path(options["save_hf"]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
