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

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))

if os.environ.get("TT_CPU_SMOKE") == "1":
    import torch
    import torch._utils
    import torch.cpu as _tcpu

    torch._utils._get_available_device_type = lambda: "cpu"

    class _Props:
        total_memory = 24 * 1024**3

    for _n, _f in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: _Props(),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }.items():
        if not hasattr(_tcpu, _n):
            setattr(_tcpu, _n, _f)
    _tcpu.memory_stats = lambda *a, **k: {}

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

if os.environ.get("TT_CPU_SMOKE") == "1":
    import torchtitan.distributed.utils as _du

    if hasattr(_du, "set_pg_timeouts"):
        _du.set_pg_timeouts = lambda *a, **k: None

if __name__ == "__main__":
    main()
