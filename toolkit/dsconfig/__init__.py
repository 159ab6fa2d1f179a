"""DeepSpeed configs: generate them right by construction, and check any JSON before a job queues.

    from toolkit.dsconfig import Setup, build, check
    config = build(Setup(gpus=64, tp=8, zero=1, micro_batch=1, global_batch=512), spec)
    report = check(config, gpus=64, tp=8)

Importing this package is cheap; `check` imports DeepSpeed (for its pydantic models) when called.
"""

from __future__ import annotations

from toolkit.dsconfig.build import build, validate
from toolkit.dsconfig.settings import Monitoring, OptimizerSettings, SchedulerSettings, Setup


def check(*args, **kwargs):
    from toolkit.dsconfig.check import check as impl

    return impl(*args, **kwargs)


__all__ = ["Monitoring", "OptimizerSettings", "SchedulerSettings", "Setup", "build", "check", "validate"]
