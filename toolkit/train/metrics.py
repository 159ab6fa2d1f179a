"""Per-step metrics: RUN_DIR/metrics.jsonl, and Weights & Biases when enabled (the console line is
toolkit.train.progress's).

Throughput uses the standard dense-transformer estimate of training FLOPs per token,
6 * N (forward + backward of every weight) + 12 * layers * hidden * seq_len (attention scores),
(Kaplan et al. 2020; PaLM appendix B), against a per-device peak.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import torch

# Nothing meaningful exists for a CPU; MFU on CPU is recorded against this nominal figure (and not printed).
CPU_NOMINAL_TFLOPS = 1.0
CPU_SOURCE = "CPU, nominal"


def peak_tflops(override: float | None, precision: str = "bf16") -> tuple[float, str]:
    """This device's dense peak for matmuls at `precision` (toolkit.peak_flops), and where it comes
    from; 0.0 where none is known (MFU is then not reported)."""
    from toolkit.peak_flops import gpu_peak, matmul_tflops, tf32_enabled

    if override:
        return override, "given"
    # precision=fp8: MFU against the bf16 peak (as torchtitan reports it), so that an FP8 run and a bf16
    # run of the same model compare; only the decoder GEMMs run in FP8
    precision = "bf16" if precision == "fp8" else precision
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = gpu_peak(name)
        if peak is None:
            return 0.0, f"unknown GPU {name} (pass peak_tflops)"
        tf32 = precision == "fp32" and tf32_enabled()
        value = matmul_tflops(peak, precision, tf32)
        if value is None:
            return 0.0, f"{name} has no {precision} tensor cores (pass peak_tflops)"
        return value, f"{name}, {'tf32' if tf32 else precision} dense"
    return CPU_NOMINAL_TFLOPS, CPU_SOURCE


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: allocated CUDA memory on a GPU; on CPU the process's peak
    resident set (everything: Python, libraries, model states, activations)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def flops_per_token(spec, seq_len: int) -> float:
    params = spec.num_layers * (
        spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim  # qkv
        + spec.num_heads * spec.head_dim * spec.hidden_size  # output projection
        + 3 * spec.hidden_size * spec.ffn_hidden_size  # gate, up, down
    ) + spec.vocab_size * spec.hidden_size  # output layer
    return 6.0 * params + 12.0 * spec.num_layers * spec.hidden_size * seq_len


class MetricsLogger:
    def __init__(self, run_dir: Path, active: bool, wandb_cfg, run_config: dict, resume_step: int = 0):
        self.active = active
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        if wandb_cfg.enabled:
            self.wandb = _init_wandb(run_dir, wandb_cfg, run_config)

    def _truncate_after(self, step: int) -> None:
        """A resumed run re-logs the steps after its checkpoint: drop the killed run's copies."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict, media: dict | None = None) -> None:
        """`media`: W&B-only values (tables) of this step, in the same W&B row (a second log at
        a committed step would be dropped); metrics.jsonl keeps the numbers."""
        if not self.active:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            # commit=True: with an explicit step wandb holds the row open until a later step or
            # finish(), so a rank 0 killed after logging would lose that step; ours are complete.
            self.wandb.log({**wandb_record(record), **(media or {})}, step=step, commit=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def wandb_record(record: dict) -> dict:
    """Per-layer, per-expert tables (tokens_per_expert) as one W&B scalar each: `KEY/layer_L/expert_E`."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, list):
            flat.update({f"{key}/layer_{l}/expert_{e}": n for l, row in enumerate(value) for e, n in enumerate(row)})
        else:
            flat[key] = value
    return flat


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path, configured: str | None) -> str:
    """The configured id, else the one this run directory was given on its first start: every
    resume of a run (local or requeued) continues the same W&B run."""
    if configured:
        return configured
    path = Path(run_dir) / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # wandb's own ids are 8 lowercase letters and digits too
    path.write_text(run_id + "\n")
    return run_id


def _init_wandb(run_dir: Path, cfg, run_config: dict):
    """Our trainer owns the W&B run (DeepSpeed's monitor would start its own and logs no loss).
    A stable id with resume="allow" makes a restarted job continue the same run."""
    import wandb

    if cfg.mode and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = cfg.mode
    return wandb.init(project=cfg.project, id=wandb_run_id(run_dir, cfg.run_id), resume="allow",
                      dir=str(run_dir), config=run_config)
