"""Keep the training log readable: third-party notices that say nothing about this run are hidden
unless `--verbose` is given (or TOOLKIT_VERBOSE=1)."""

from __future__ import annotations

import os
import warnings

# Warnings every run prints that concern the libraries, not the user's job.
KNOWN_NOISE = (
    dict(category=FutureWarning),
    dict(category=DeprecationWarning),
    dict(category=UserWarning, module="megatron"),  # missing apex/TE, deprecated defaults of its own config
    dict(category=UserWarning, module="deepspeed"),
    dict(category=UserWarning, module="torch.distributed"),  # dist-checkpoint notices
)


def quiet_third_party(verbose: bool) -> None:
    if verbose or os.environ.get("TOOLKIT_VERBOSE") == "1":
        return
    for rule in KNOWN_NOISE:
        warnings.filterwarnings("ignore", **rule)
    # Child processes (dist-checkpoint workers) inherit the same filters.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
