"""Launcher for torchtitan 0.3.0 (benchmark anchor kit; 0.3.0's files are untouched).

    python3 benchmarks/torchtitan_anchor/launch_v030.py --module tt030_cfg --config llama3_1b_ours [--flags ...]

* Single process without torchrun: fills RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* if unset.
* TT030_SHIM=1: torch 2.11 lacks torch.distributed.fsdp.DataParallelMeshDims (and
  fully_shard's dp_mesh_dims= keyword), which 0.3.0's torchtitan/distributed/fsdp.py
  imports at module level.  The shim defines a stand-in class so the import succeeds;
  pair it with --parallelism.spmd_backend partial_dtensor so 0.3.0 passes no
  dp_mesh_dims to fully_shard.  Nothing else is patched.
* TT_CPU_SMOKE=1: local CPU plumbing check only (gloo, no CUDA).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for tt030_cfg

from single_process import CPU_SMOKE, skip_cpu_barrier_timeouts  # noqa: E402  (before torchtitan)

if os.environ.get("TT030_SHIM") == "1":
    import dataclasses

    import torch.distributed.fsdp as _fsdp

    if not hasattr(_fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:  # stand-in; only used as a type / passed through
            shard: tuple = ()
            replicate: tuple = ()

        _fsdp.DataParallelMeshDims = DataParallelMeshDims
        print("[anchor kit] shim: added stand-in torch.distributed.fsdp.DataParallelMeshDims",
              file=sys.stderr)

# Import our config module up front: 0.3.0's ConfigManager imports --module inside
# `except ImportError: continue`, which would hide the real ImportError (e.g. a torch
# API missing in 2.11) behind "Cannot import module 'tt030_cfg'".
import tt030_cfg  # noqa: E402,F401
from torchtitan.train import main  # noqa: E402

if CPU_SMOKE:
    skip_cpu_barrier_timeouts()

if __name__ == "__main__":
    main()
