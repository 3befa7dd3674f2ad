"""The background process that writes ``async_pinned`` checkpoints: torch DCP's own, started without its INFO log.

torch's writer process sets its root logger to INFO and logs three or more lines per save ("Received async
checkpoint request with id=None", ...). Started through ``start_quiet_writer``, the same process logs warnings
and errors only; ``DistributedCheckpointIO`` prints one line per save instead. Where torch's private names have
moved (another torch version), DCP starts its process itself, as loud as before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor as _executor

__all__ = ["start_quiet_writer"]

_HAS_PRIVATE_NAMES = all(hasattr(_executor, name) for name in
                         ("_AsyncCheckpointProcess", "_ProcessGroupInitInfo", "_CHECKPOINT_PROCESS", "_init_logger"))


def _warnings_only(rank: int) -> None:
    _init_logger(rank)  # torch's handler and rank prefix, for the warnings and errors that remain
    logging.getLogger().setLevel(logging.WARNING)


if _HAS_PRIVATE_NAMES:
    _init_logger = _executor._init_logger

    class _QuietCheckpointProcess(_executor._AsyncCheckpointProcess):
        @staticmethod
        def _checkpointing_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
            # Runs in the spawned writer, which imports this module to find it.
            _executor._init_logger = _warnings_only
            _executor._AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, parent_conn)


def start_quiet_writer(group: dist.ProcessGroup) -> None:
    """Start DCP's writer process, quiet, if it is not running. Every rank of ``group`` calls this together."""
    if _HAS_PRIVATE_NAMES and _executor._CHECKPOINT_PROCESS is None:
        _executor._CHECKPOINT_PROCESS = _QuietCheckpointProcess(_executor._ProcessGroupInitInfo(group))
