"""Slurm: render an sbatch script for the fine-tuning recipe, submit it, and report on the job.

    from toolkit.slurm import SlurmJob, Resources, Launch, render, submit, status
    job = SlurmJob(config="recipes/qwen3-30b-a3b-ep.yaml", resources=Resources(nodes=2, gpus_per_node=8))
    script = render(job)            # validated; every user value shell-quoted

Importing this package is cheap (no torch); rendering reads the recipe YAML to check the layout.
"""

from __future__ import annotations

from toolkit.slurm.render import Launch, Preemption, Resources, SlurmJob, WandbSettings, render
from toolkit.slurm.status import JobStatus, status
from toolkit.slurm.submit import Submission, submit

__all__ = ["JobStatus", "Launch", "Preemption", "Resources", "SlurmJob", "Submission",
           "WandbSettings", "render", "status", "submit"]
