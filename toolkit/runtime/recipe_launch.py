"""Run recipes/finetune.py under torchrun on local processes, as `toolkit quickstart` and `toolkit parity` do.

The ranks run on CPU unless the machine has a GPU for each (`recipe_device`): on a 1-GPU box the
tiny example still runs, where `toolkit.runtime.launch` would refuse a launch one GPU short.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from toolkit.errors import ToolkitError

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"


def recipe_device(nprocs: int, cuda_available: bool, device_count: int) -> str:
    """"cuda" where every process gets a GPU of its own, else "cpu" (gloo; the GPUs hidden)."""
    return "cuda" if cuda_available and device_count >= nprocs else "cpu"


def on_cpu(nprocs: int) -> bool:
    import torch

    return recipe_device(nprocs, torch.cuda.is_available(), torch.cuda.device_count()) == "cpu"


def launch_recipe(nprocs: int, recipe: Path, overrides: list[str], run_dir: Path, launcher: list[str] | None = None,
                  capture: bool = False, env: dict | None = None) -> str:
    """torchrun of the recipe on `nprocs` local processes, with the GPUs hidden where there are too few.
    `launcher`: another command that starts the ranks (as torchrun's arguments before the script);
    `capture`: the ranks' output returned (and its error line raised) instead of printed; `env`: more variables."""
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    launcher = launcher or [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
    cmd = [*launcher, str(RECIPE_DIR / "finetune.py"), "--config", str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    if on_cpu(nprocs):
        env["CUDA_VISIBLE_DEVICES"] = ""  # the ranks see no GPU: gloo on CPU
    result = subprocess.run(cmd, env=env, capture_output=capture, text=True)
    if result.returncode != 0:
        output = [line for line in ((result.stdout or "") + "\n" + (result.stderr or "")).splitlines() if line.strip()]
        said = [line for line in output if line.startswith("error")] or output[-1:]  # the recipe's line, or the last
        reason = re.sub(r"^error( \(rank \d+\))?: ", "", said[0]) if said else " ".join(cmd)
        raise ToolkitError(f"fine-tuning failed: {reason}")
    return (result.stdout or "") + (result.stderr or "")
