"""DeepSpeed configs: generate them right by construction, and check any JSON before a job queues.

    from toolkit.dsconfig import Setup, build, check
    config = build(Setup(gpus=64, tp=8, zero=1, micro_batch=1, global_batch=512), spec)
    report = check(config, gpus=64, tp=8)

Importing this package is cheap; `check` imports DeepSpeed (for its pydantic models) when called.
"""

from __future__ import annotations

from toolkit.dsconfig.build import build, validate

# Imported eagerly (it is cheap: DeepSpeed is imported inside it when called). A lazy wrapper named
# `check` would be replaced by the submodule toolkit.dsconfig.check the first time that is imported.
from toolkit.dsconfig.check import check
from toolkit.dsconfig.settings import Monitoring, OptimizerSettings, SchedulerSettings, Setup


__all__ = ["Monitoring", "OptimizerSettings", "SchedulerSettings", "Setup", "build", "check", "validate"]
