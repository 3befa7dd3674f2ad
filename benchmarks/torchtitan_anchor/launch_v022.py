"""Launcher for torchtitan v0.2.2 (benchmark anchor kit; torchtitan's own files are untouched).

    python3 benchmarks/torchtitan_anchor/launch_v022.py --job.config_file benchmarks/torchtitan_anchor/v022_1b.toml ...

* Registers the flavor "1B_ours" in llama3's flavor dict (the dict object that
  get_train_spec() hands to the Trainer), so no torchtitan file is edited.
* Single process without torchrun: fills RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* if unset.
* TT_FORCE_FSDP=1: FSDP2 (fully_shard) on a single GPU.  v0.2.2 only applies FSDP
  when dp_shard > 1 or cp > 1 (ParallelDims.fsdp_enabled), and dp_shard must equal
  the world size (1), so there is no config switch for it.  This patch makes
  fsdp_enabled true and hands parallelize_llama a real 1-rank "fsdp" DeviceMesh
  (default NCCL group) instead of the fake-backend size-1 sub-mesh; everything
  else is torchtitan's own code path (apply_fsdp with MixedPrecisionPolicy
  param bf16 / reduce fp32, reshard_after_forward per config, no autocast).
* TT_CPU_SMOKE=1: only for the local CPU plumbing check (gloo, no CUDA).
"""

import os
import sys

# torchtitan v0.2.2 itself, unpacked by build_kit.sh into the git-ignored .tt/ at the repo root.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".tt", "v022"))

from single_process import CPU_SMOKE, skip_cpu_barrier_timeouts  # noqa: E402  (before torchtitan)

if CPU_SMOKE:
    try:
        import triton  # noqa: F401
    except ImportError:
        # CPU box without triton: only torchtitan/models/moe/kernels.py (MoE
        # token permutation, unused by llama3) imports it; stand in for that module.
        import types

        _k = types.ModuleType("torchtitan.models.moe.kernels")

        def generate_permute_indices(*a, **k):
            raise RuntimeError("MoE triton kernels are not available in the CPU smoke run")

        _k.generate_permute_indices = generate_permute_indices
        sys.modules["torchtitan.models.moe.kernels"] = _k

from torchtitan.models.llama3 import llama3_args  # noqa: E402
from torchtitan.models.llama3.model.args import (  # noqa: E402
    RoPEScalingArgs,
    TransformerModelArgs,
)

# Our 1B shape: FeedForward hidden = 4*dim=8192 -> int(2*8192/3)=5461
# -> int(1.5*5461)=8191 -> round up to multiple_of 256 -> 8192.
# Untied output projection (torchtitan's llama3 never ties), SDPA attention,
# Llama 3.2 rope scaling (factor 32) as in our llama_module "1B".
llama3_args["1B_ours"] = TransformerModelArgs(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=256,
    ffn_dim_multiplier=1.5,
    rope_theta=500000,
    rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0),
    attn_type="sdpa",
    attn_mask_type="causal",
)

if CPU_SMOKE:
    # tiny model with the full 128256 vocab, for the CPU plumbing check only
    llama3_args["smoke_128k"] = TransformerModelArgs(
        dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128256,
        rope_theta=500000, attn_type="sdpa",
    )

if os.environ.get("TT_FORCE_FSDP") == "1":
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.tools.logging import logger
    from torchtitan.tools.utils import device_type

    ParallelDims.fsdp_enabled = property(lambda self: True)
    _orig_get_mesh = ParallelDims.get_mesh
    _fsdp_mesh = {}

    def _get_mesh(self, dims):
        names = [dims] if isinstance(dims, str) else list(dims)
        if names == ["fsdp"] and self.dp_shard * self.cp == 1 and self.world_size == 1:
            if "m" not in _fsdp_mesh:
                _fsdp_mesh["m"] = init_device_mesh(
                    device_type, (1,), mesh_dim_names=("fsdp",)
                )
                logger.info("[anchor kit] forcing FSDP2 on a 1-rank real mesh")
            return _fsdp_mesh["m"]
        return _orig_get_mesh(self, dims)

    ParallelDims.get_mesh = _get_mesh

from torchtitan.train import Trainer, main  # noqa: E402

if CPU_SMOKE:
    skip_cpu_barrier_timeouts()

if __name__ == "__main__":
    main(Trainer)
