"""Pipeline layout arithmetic and FQN-stable stage splitting, without any process group."""

from __future__ import annotations

import pytest
import torch

from llama_module import LlamaConfig
from llama_module.model import Llama
from llama_module.plan import llama_plan
from titan_strategy.config.pipeline import PipelineConfig
from titan_strategy.pipeline.layout import check_microbatch_split
from titan_strategy.pipeline.split import split_for_rank, stage_module_names

pytestmark = pytest.mark.unit


def _blocks(config: PipelineConfig, num_blocks: int) -> list[list[int]]:
    return [list(r) for r in config.resolve(num_blocks).blocks]


@pytest.mark.parametrize(("config", "num_blocks", "blocks", "ranks"), [
    (PipelineConfig(2, "1F1B"), 4, [[0, 1], [2, 3]], [0, 1]),
    # The remainder goes to the middle stages: the first and last also carry embedding and output.
    (PipelineConfig(4, "1F1B"), 6, [[0], [1, 2], [3, 4], [5]], [0, 1, 2, 3]),
    (PipelineConfig(2, "Interleaved1F1B"), 8, [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 0, 1]),
    (PipelineConfig(2, "ZBVZeroBubble"), 4, [[0], [1], [2], [3]], [0, 1, 1, 0]),
    (PipelineConfig(4, "DualPipeV"), 8, [[i] for i in range(8)], [0, 1, 2, 3, 3, 2, 1, 0]),
    (PipelineConfig(2, "LoopedBFS", stages_per_rank=3), 6, [[i] for i in range(6)], [0, 1, 0, 1, 0, 1]),
    # 10 blocks at 3 per stage: 4 stages, the last and the first each give one up.
    (PipelineConfig(2, "Interleaved1F1B", layers_per_stage=3), 10, [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]],
     [0, 1, 0, 1]),
    (PipelineConfig(2, "GPipe", split_points=(1,)), 4, [[0], [1, 2, 3]], [0, 1]),
], ids=["1f1b-even", "1f1b-remainder", "interleaved-loop", "zbv-v", "dualpipev-v", "three-per-rank",
        "layers-per-stage", "split-points"])
def test_layout_splits_blocks_and_places_stages(config: PipelineConfig, num_blocks: int, blocks: list[list[int]],
                                                ranks: list[int]) -> None:
    layout = config.resolve(num_blocks)
    assert _blocks(config, num_blocks) == blocks
    assert list(layout.ranks) == ranks
    assert layout.microbatches == len(blocks)  # default: one per stage, which every schedule accepts
    assert sorted(s for rank in range(config.size) for s in layout.stages_of(rank)) == list(range(len(blocks)))


@pytest.mark.parametrize(("config", "num_blocks", "message"), [
    (PipelineConfig(2, "Interleaved1F1B"), 2, r"The model has 2 blocks, fewer than the 4 pipeline stages "
                                              r"\(pipeline_parallel_size=2 x 2 per rank\)"
                                              r".*Lower pipeline_parallel_size"),
    (PipelineConfig(4, "1F1B", microbatches=2), 8, r"pipeline_schedule='1F1B' needs at least 4 microbatches .* but "
                                                   r"pipeline_microbatches=2; raise it to 4"),
    (PipelineConfig(2, "DualPipeV", microbatches=3), 8, r"'DualPipeV' needs at least 4 microbatches"),
    (PipelineConfig(4, "Interleaved1F1B", microbatches=9), 8, r"pipeline_microbatches=9 is not a multiple of its 2 "
                                                              r"rounds. Use a multiple of 4"),
    (PipelineConfig(2, "ZBVZeroBubble", layers_per_stage=1), 6,
     r"pipeline_layers_per_stage=1 over 6 blocks gives 3 stages per rank, but .*'ZBVZeroBubble' needs exactly 2"),
    (PipelineConfig(2, "1F1B", layers_per_stage=1), 4,
     r"gives 2 stages per rank, but pipeline_schedule='1F1B' runs one"),
    (PipelineConfig(2, "1F1B", split_points=(1, 2)), 4, r"pipeline_split_points=\[1, 2\] gives 3 stages, which "
                                                        r"pipeline_parallel_size=2 ranks cannot share evenly"),
    (PipelineConfig(2, "GPipe", split_points=(4,)), 4, r"pipeline_split_points=\[4\] must lie strictly between 0 and "
                                                       r"the model's 4 blocks"),
    (PipelineConfig(2, "LoopedBFS", stages_per_rank=2, layers_per_stage=1), 6,
     r"gives 3 stages per rank, but pipeline_stages_per_rank=2; drop one of the two knobs"),
], ids=["too-few-blocks", "1f1b-microbatches", "dualpipev-microbatches", "interleaved-rounds", "v-needs-two",
        "single-needs-one", "uneven-split", "empty-stage", "conflicting-knobs"])
def test_bad_layouts_fail_with_the_knob_to_change(config: PipelineConfig, num_blocks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config.resolve(num_blocks)


def test_unknown_schedule_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"pipeline_schedule='ZB' must be one of \['GPipe', '1F1B', "
                                         r"'Interleaved1F1B', 'LoopedBFS', 'InterleavedZeroBubble', 'ZBVZeroBubble', "
                                         r"'DualPipeV'\]"):
        PipelineConfig(2, "ZB")


def test_batch_must_split_into_equal_microbatches() -> None:
    check_microbatch_split(8, 4)
    with pytest.raises(ValueError, match=r"A batch of 6 samples cannot be split into pipeline_microbatches=4 equal"):
        check_microbatch_split(6, 4)


def _meta_llama(n_layers: int) -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig(dim=64, n_layers=n_layers, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=128,
                                 max_seq_len=64))


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_stages_keep_the_full_models_parameter_names(schedule: str) -> None:
    full_names = {name for name, _ in _meta_llama(4).named_parameters()}
    config = PipelineConfig(2, schedule)
    layout = config.resolve(4)
    names_by_rank = []
    for rank in range(2):
        model = _meta_llama(4)
        plan = llama_plan(model)
        assert plan.pipeline is not None
        parts = split_for_rank(model, stage_module_names(plan.blocks, plan.pipeline, layout), layout.stages_of(rank))
        rank_names = {name for name, _ in model.named_parameters()}
        # The stages share their parameters with the pruned model, under the same names.
        part_params = {id(p) for part in parts for p in part.parameters()}
        assert part_params == {id(p) for p in model.parameters()}
        assert set().union(*({n for n, _ in part.named_parameters()} for part in parts)) == rank_names
        names_by_rank.append(rank_names)
    assert names_by_rank[0] | names_by_rank[1] == full_names
    assert not names_by_rank[0] & names_by_rank[1]


def test_a_stage_without_embedding_or_head_runs_on_hidden_states() -> None:
    model = _meta_llama(4)
    plan = llama_plan(model)
    assert plan.pipeline is not None
    layout = PipelineConfig(2, "ZBVZeroBubble").resolve(4)
    middle = split_for_rank(model, stage_module_names(plan.blocks, plan.pipeline, layout), [1, 2])
    assert middle[0].tok_embeddings is None and middle[0].output is None and list(middle[0].layers) == ["1"]
    assert list(middle[1].layers) == ["2"] and list(model.layers) == ["1", "2"]
    hidden = torch.empty(2, 16, 64, device="meta")
    assert middle[1](middle[0](hidden)).shape == (2, 16, 64)


def test_a_pipeline_plan_that_cannot_log_its_loss_is_refused_before_the_model_is_touched() -> None:
    from titan_strategy.config import TitanConfig
    from titan_strategy.config.mesh import ParallelDims
    from titan_strategy.parallelize.apply import check_plan

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2)
    config = TitanConfig.from_knobs(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 runs the pipeline schedule in place of the "
                                         r"module's steps, which log the loss; give the module's PipelinePlan "
                                         r"log_loss="):
        check_plan(llama_plan(_meta_llama(4)), dims, config)
    assert check_plan(llama_plan(_meta_llama(4), log_loss=lambda stage, loss: None), dims, config) is not None
