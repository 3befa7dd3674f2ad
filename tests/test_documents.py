"""Block-causal attention over packed documents: each document of a window gets the logits it would get alone,
with every kernel; the batch's document ids, boundary labels and bad input."""

from __future__ import annotations

import itertools
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch._dynamo
from torch import Tensor
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from llama_module.args import LlamaConfig
from llama_module.model import Llama
from llama_module.packed_windows import packed_window
from tests.conftest import launch
from tests.support.run_spec import DataSpec, ModelSpec, RunSpec
from titan_strategy.parallelize.activation_checkpoint import apply_ac
from titan_strategy.parallelize.compile import apply_compile
from titan_strategy.token_loss import token_cross_entropy

TINY = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=64)
LENGTHS = (5, 11, 1, 15)  # uneven, one of a single token; 32 tokens in all


def _documents(batch: int = 2) -> tuple[list[Tensor], Tensor, Tensor]:
    """Per sequence of the batch: its documents, and together the packed tokens and document ids (bs, 32)."""
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, TINY.vocab_size, (n,), generator=generator) for n in LENGTHS * batch]
    tokens = torch.stack([torch.cat(documents[i * len(LENGTHS):(i + 1) * len(LENGTHS)]) for i in range(batch)])
    ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).expand(batch, -1)
    return documents, tokens, ids.clone()


def _model(kernel: str = "sdpa", mask: str = "block_causal", rope_positions: str = "document",
           device: str = "cpu") -> Llama:
    model = Llama(TINY, kernel, mask, rope_positions).to(device)
    model.init_weights(seed=0)
    return model


def _alone(model: Llama, documents: list[Tensor]) -> list[Tensor]:
    """Each document's logits run on its own, under plain causal attention."""
    return [model(document[None], torch.zeros(1, len(document), dtype=torch.long, device=document.device))[0]
            for document in documents]


def _per_document(packed: Tensor) -> list[Tensor]:
    return [piece for sequence in packed for piece in sequence.split(LENGTHS)]


@pytest.mark.unit
@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@torch.no_grad()  # FlexAttention has no backward on CPU
def test_each_packed_document_gets_the_logits_and_loss_it_gets_alone(kernel: str) -> None:
    documents, tokens, ids = _documents()
    alone = _alone(_model(mask="causal"), documents)
    packed = _model(kernel)(tokens, ids)
    for document, mine, reference in zip(documents, _per_document(packed), alone):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
        loss, count = token_cross_entropy(mine[None, :-1], document[None, 1:])
        expected, _ = token_cross_entropy(reference[None, :-1], document[None, 1:])
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_gradients_of_a_packed_window_are_the_sum_of_its_documents() -> None:
    documents, tokens, ids = _documents(batch=1)
    packed_model, alone_model = _model(), _model(mask="causal")
    logits = packed_model(tokens, ids)
    token_cross_entropy(logits[:, :-1], tokens[:, 1:].masked_fill(ids[:, 1:] != ids[:, :-1], -100))[0].backward()
    for document, reference in zip(documents, _alone(alone_model, documents)):
        token_cross_entropy(reference[None, :-1], document[None, 1:])[0].backward()
    for (name, mine), theirs in zip(packed_model.named_parameters(), alone_model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.unit
@torch.no_grad()
def test_positions_restart_per_document_and_the_causal_mask_attends_across_documents() -> None:
    documents, tokens, ids = _documents(batch=1)
    alone = _alone(_model(mask="causal"), documents)
    starts = torch.tensor([0, 5, 16, 17]).repeat_interleave(torch.tensor(LENGTHS))
    by_document, _ = _model().documents(ids)
    by_window, _ = _model(rope_positions="window").documents(ids)
    assert by_document.tolist() == [(torch.arange(32) - starts).tolist()] and by_window.tolist() == list(range(32))
    # RoPE scores see only position differences, so inside a document the window's positions give the same
    # logits up to rounding.
    for mine, reference in zip(_per_document(_model(rope_positions="window")(tokens, ids)), alone):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    causal = _model(mask="causal")
    torch.testing.assert_close(causal(tokens, ids), causal(tokens))  # the causal mask ignores document ids
    across_documents = _per_document(causal(tokens))
    torch.testing.assert_close(across_documents[0], alone[0])
    for later in (1, 3):
        assert not torch.allclose(across_documents[later], alone[later], atol=1e-3)


@pytest.mark.unit
def test_a_packed_window_numbers_its_documents_and_can_mask_the_boundary_labels() -> None:
    bos = 1
    window = torch.tensor([7, 8, bos, 9, 9, 9, bos, bos, 4])  # a partial document, then three more
    sample = packed_window(window, bos)
    assert sample["document_ids"].tolist() == [0, 0, 1, 1, 1, 1, 2, 3]
    assert sample["labels"].tolist() == window[1:].tolist()
    masked = packed_window(window, bos, mask_boundary_labels=True)
    assert masked["labels"].tolist() == [8, -100, 9, 9, 9, -100, -100, 4]
    assert packed_window(torch.tensor([bos, 5, 6]), bos)["document_ids"].tolist() == [0, 0]


@pytest.mark.unit
def test_bad_document_ids_fail_before_the_step_with_the_fix() -> None:
    module = LlamaModule(model=TINY, attention_mask="block_causal")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    cases = [
        ({"input_ids": tokens}, r"needs the batch's 'document_ids' \(batch, seq_len\), which TextDataModule gives"),
        ({"input_ids": tokens, "document_ids": tokens.float()},
         r"document_ids must be a LongTensor \(batch, seq_len\); got torch.float32 of shape \(2, 8\)"),
        ({"input_ids": tokens, "document_ids": tokens[:, :4]},
         r"document_ids has shape \(2, 4\), but input_ids has \(2, 8\); give one document id per input token"),
    ]
    hooks = [module.on_train_batch_start, module.on_validation_batch_start, module.on_test_batch_start,
             module.on_predict_batch_start]
    for (batch, message), hook in itertools.product(cases, hooks):
        with pytest.raises(ValueError, match=message):
            hook(batch, 0)
    LlamaModule(model=TINY).on_train_batch_start({"input_ids": tokens}, 0)  # causal needs none


class _OwnTransfer(L.LightningDataModule):
    """A user's DataModule with its own ``on_after_batch_transfer`` and ``document_ids`` half as long as the
    windows (which only the batch-start check names: the model alone would fail somewhere in attention)."""

    def train_dataloader(self) -> DataLoader:
        tokens = torch.zeros(4, 9, dtype=torch.long)
        return DataLoader([{"input_ids": t[:-1], "labels": t[1:], "document_ids": t[:4]} for t in tokens],
                          batch_size=2)

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        return batch


@pytest.mark.unit
def test_a_trainer_refuses_mismatched_document_ids_before_the_first_step(tmp_path: Path) -> None:
    module = LlamaModule(model=TINY, attention_mask="block_causal")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"document_ids has shape \(2, 4\), but input_ids has \(2, 8\)"):
        trainer.fit(module, _OwnTransfer())
    assert trainer.global_step == 0


@pytest.mark.multiprocess
def test_flex_is_refused_on_cpu_before_the_model_exists(tmp_path: Path, test_env: dict[str, str]) -> None:
    spec = RunSpec(steps=1, batch_size=2, model=ModelSpec(attention_kernel="flex", attention_mask="block_causal"),
                   data=DataSpec(documents=True))
    with pytest.raises(AssertionError, match=r"attention_kernel='flex' trains on CUDA only: torch has no "
                                             r"FlexAttention backward on CPU\. Use attention_kernel='sdpa'"):
        launch(1, spec, tmp_path, test_env)


def _graph_breaks_of_a_compiled_step(model: Llama, tokens: Tensor, ids: Tensor) -> int:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_ac(model, {name: i for i, name in enumerate(f"layers.{n}" for n in model.layers)}, "selective_op")
    apply_compile(model, tuple(f"layers.{name}" for name in model.layers))
    model(tokens, ids).float().square().mean().backward()
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.unit
def test_compiled_blocks_take_the_dense_mask_without_graph_breaks() -> None:
    _, tokens, ids = _documents()
    assert _graph_breaks_of_a_compiled_step(_model(), tokens, ids) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
def test_flex_trains_like_the_dense_mask_on_cuda_and_compiles_without_graph_breaks() -> None:
    documents, tokens, ids = _documents()
    tokens, ids = tokens.cuda(), ids.cuda()
    results = {}
    for kernel in ("sdpa", "flex"):
        model = _model(kernel, device="cuda")
        logits = model(tokens, ids)
        token_cross_entropy(logits[:, :-1], tokens[:, 1:])[0].backward()
        results[kernel] = (logits, [p.grad for p in model.parameters()])
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], rtol=1e-4, atol=1e-4)
    for flex_grad, dense_grad in zip(results["flex"][1], results["sdpa"][1]):
        torch.testing.assert_close(flex_grad, dense_grad, rtol=1e-3, atol=1e-5)
    alone = _alone(_model(mask="causal", device="cuda"), [d.cuda() for d in documents])
    for mine, reference in zip(_per_document(results["flex"][0]), alone):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    assert _graph_breaks_of_a_compiled_step(_model("flex", device="cuda"), tokens, ids) == 0
