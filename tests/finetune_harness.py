"""Helpers for the fine-tuning tests: a tiny model, data with unequal lengths, launching the
recipe under torchrun, and the independent single-process HF reference."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune.py"


def write_uneven_data(path: Path, n: int, seed: int = 0) -> Path:
    """Prompts and responses of different lengths, so micro-batches hold different token counts
    and a mean of per-micro-batch means would differ from the true mean."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        prompt = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9))) + "="
        response = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 10)))
        lines.append(json.dumps({"prompt": prompt, "response": response}))
    path.write_text("\n".join(lines) + "\n")
    return path


def recipe(tmp: Path, checkpoint: Path, data: Path, **overrides) -> Path:
    cfg = {
        "model": {"checkpoint": str(checkpoint)},
        "data": {"train_file": str(data), "seq_len": 24, "shuffle": False},
        "optim": {"lr": 2e-3, "warmup_steps": 3, "schedule": "cosine", "weight_decay": 0.1, "clip_grad": 1.0},
        "precision": "fp32",
        "micro_batch": 2,
        "global_batch": 16,
        "steps": 10,
        "log_every": 1,
        "run_dir": str(tmp / "run"),
        "export_hf": False,
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[key] = value
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launcher_command(nprocs: int, launcher: str) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
    # DeepSpeed's launcher starts one process per "GPU"; on CPU it must be told how many.
    from toolkit.runtime.launch import free_port

    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(free_port())]


def launch(nprocs: int, recipe_path: Path, *overrides: str, env: dict | None = None, wait: bool = True,
           launcher: str = "torchrun", expect_failure: bool = False):
    cmd = [*launcher_command(nprocs, launcher), str(RECIPE), "--config", str(recipe_path), *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu", **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    result = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900)
    if expect_failure:
        assert result.returncode != 0, result.stdout[-4000:]
    else:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def hf_reference(hf_dir: Path, data: Path, cfg_path: Path, steps: int) -> tuple[list[float], list[float]]:
    """Single-process HF transformers + torch.optim.AdamW on the unconverted weights, over the
    same global batches: loss = sum of token losses over the global batch / its token count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.train.config import load_config
    from toolkit.train.data import BatchSource, load_rows
    from toolkit.train.parallel import lr_lambda

    cfg = load_config(str(cfg_path))
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    rows, _ = load_rows(data, tokenizer, cfg.data.seq_len, cfg.data.pack, "truncate", "error")
    source = BatchSource(rows, cfg.global_batch, cfg.global_batch, 1, 0, cfg.seed, cfg.data.shuffle, cfg.data.pack)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    losses, norms = [], []
    for _ in range(steps):
        (batch,) = source.next_global_batch()
        opt.zero_grad()
        logits = model(input_ids=batch["tokens"]).logits.float()
        token_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                                       reduction="none")
        loss = (token_loss * batch["loss_mask"].reshape(-1)).sum() / batch["loss_mask"].sum()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)))
        opt.step()
        sched.step()
        losses.append(float(loss))
    return losses, norms
