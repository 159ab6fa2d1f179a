"""Keep the training log readable: third-party notices that say nothing about this run are hidden
unless `--verbose` is given (or TOOLKIT_VERBOSE=1)."""

from __future__ import annotations

import logging
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

# torch's own loggers (glog-style lines, "W1202 08:06:29 ..."): on a machine without CUDA, DeepSpeed's import of
# torch.utils.cpp_extension says so on every rank; torchao 0.18 under torch 2.14 registers enums with pytree, which
# torch 2.14 calls deprecated, on every import
NOISY_LOGGERS = ("torch.utils.cpp_extension", "torch.utils._pytree")


def quiet_third_party(verbose: bool) -> None:
    if verbose or os.environ.get("TOOLKIT_VERBOSE") == "1":
        return
    for rule in KNOWN_NOISE:
        warnings.filterwarnings("ignore", **rule)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # Child processes (dist-checkpoint workers) inherit the same filters.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
