"""Capacity planning: which 4-D layouts fit a model on a cluster, how much memory each rank needs, how fast.

``estimate.py`` models one layout, ``search.py`` enumerates and ranks them, ``report.py`` prints and
draws them, ``hardware.py`` holds the GPU table. ``titan plan`` (``llama_module/plan_cli.py``) is the
command line.
"""

from titan_strategy.planner.estimate import Estimate, Job, Layout, ModelShape, estimate
from titan_strategy.planner.hardware import GPUS, get_gpu
from titan_strategy.planner.search import Plan, PlanError, check_layout, plan_layouts

__all__ = ["GPUS", "Estimate", "Job", "Layout", "ModelShape", "Plan", "PlanError", "check_layout", "estimate",
           "get_gpu", "plan_layouts"]
