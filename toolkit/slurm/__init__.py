"""Slurm: render an sbatch script for the fine-tuning recipe, submit it, and report on the job.

    from toolkit.slurm import SlurmJob, Resources, Launch, render, submit, status
    job = SlurmJob(config="recipes/qwen3-30b-a3b-ep.yaml", resources=Resources(nodes=2, gpus_per_node=8))
    script = render(job)            # validated; every user value shell-quoted

Importing this package is cheap (no torch); rendering reads the recipe YAML to check the layout.
"""

from __future__ import annotations

from toolkit.errors import ToolkitError


class SlurmError(ToolkitError):
    """A job cannot be rendered, submitted or inspected as asked."""


from toolkit.slurm.render import Launch, Preemption, Resources, SlurmJob, WandbSettings, render  # noqa: E402
from toolkit.slurm.status import JobStatus, status  # noqa: E402
from toolkit.slurm.submit import Submission, submit  # noqa: E402

__all__ = ["JobStatus", "Launch", "Preemption", "Resources", "SlurmError", "SlurmJob", "Submission",
           "WandbSettings", "render", "status", "submit"]
