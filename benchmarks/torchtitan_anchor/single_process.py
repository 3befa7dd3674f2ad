"""What both launchers set up before torchtitan is imported: one process without torchrun, and, for the CPU check
of the kit's plumbing only (``TT_CPU_SMOKE=1``), torch's CPU module standing in for the CUDA calls torchtitan makes
to name the device and read its memory."""

import os

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))

CPU_SMOKE = os.environ.get("TT_CPU_SMOKE") == "1"

if CPU_SMOKE:
    import torch._utils
    import torch.cpu

    # torchtitan picks its device type at import time.
    torch._utils._get_available_device_type = lambda: "cpu"

    class _Properties:
        total_memory = 24 * 1024**3

    for name, stand_in in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: _Properties(),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, stand_in)
    torch.cpu.memory_stats = lambda *a, **k: {}


def skip_cpu_barrier_timeouts() -> None:
    """On CPU, torchtitan's ``set_pg_timeouts`` runs a barrier with ``device_ids=['cpu']``, which c10d refuses;
    one process has nobody to wait for."""
    import torchtitan.distributed.utils as distributed_utils

    if hasattr(distributed_utils, "set_pg_timeouts"):
        distributed_utils.set_pg_timeouts = lambda *a, **k: None
