"""Lightning's process launcher, made to check the module before it starts the other ranks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from titan_strategy.callbacks.flight_recorder import RUN_ID_ENV

__all__ = ["ModuleCheckingLauncher"]


class ModuleCheckingLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher, which first checks the module: it starts the other ranks (re-running the
    script's command line) before the trainer hands the module to the strategy, so an error raised later
    would leave those processes running.

    The ranks it starts inherit one run id, so their Flight Recorder dumps share one run folder.
    """

    def __init__(self, check_module: Callable[[pl.LightningModule], None], *args: Any) -> None:
        super().__init__(*args)
        self._check_module = check_module
        os.environ.setdefault(RUN_ID_ENV, time.strftime("%Y%m%d-%H%M%S"))

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if args and isinstance(args[0], pl.LightningModule):  # fit, validate, test and predict pass it first
            self._check_module(args[0])
        return super().launch(function, *args, trainer=trainer, **kwargs)
