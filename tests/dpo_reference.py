"""TRL 1.16's real DPOTrainer as the reference for method=dpo: fp32 on CPU, single process, the
same tiny HF model, data order (sequential), hyper-parameters (torch AdamW, constant LR, no warmup,
no weight decay) and global batch (one forward of every pair of the step, no accumulation).

Returns each step's logged loss, gradient norm (before clipping) and TRL's rewards/* and logps/*."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

METRIC_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


def write_preference_data(path: Path, n: int, seed: int = 0) -> Path:
    """Digit prompts with two completions of different lengths (so pairs hold unequal token counts)."""
    import random

    rng = random.Random(seed)

    def digits(lo, hi):
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))

    lines = [json.dumps({"prompt": digits(1, 6) + "=", "chosen": digits(1, 7), "rejected": digits(1, 7)}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def trl_reference(hf_dir: Path, cfg_path: Path, steps: int, adapter: Path | None = None) -> list[dict]:
    """One dict of METRIC_KEYS per step. `adapter`: an HF PEFT adapter to train (TRL's reference is
    then a frozen copy of it, TRL's "ref" adapter)."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cfg = yaml.safe_load(cfg_path.read_text())
    optim, dpo = cfg["optim"], cfg.get("dpo", {})
    assert cfg["data"].get("shuffle") is False and optim["schedule"] == "constant" and optim["warmup_steps"] == 0
    assert optim["weight_decay"] == 0.0
    rows = [json.loads(line) for line in Path(cfg["data"]["train_file"]).read_text().splitlines() if line]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    logged = []

    class Capture(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append({k: float(logs[k]) for k in METRIC_KEYS})

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            output_dir=out, per_device_train_batch_size=cfg["global_batch"], gradient_accumulation_steps=1,
            learning_rate=optim["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=optim["clip_grad"], optim="adamw_torch",
            max_steps=steps, logging_steps=1, use_cpu=True, bf16=False, fp16=False,  # fp32 (DPOConfig defaults to bf16)
            report_to=[], save_strategy="no", disable_tqdm=True,
            train_sampling_strategy="sequential", seed=cfg.get("seed", 1234), dataloader_num_workers=0,
            beta=dpo.get("beta", 0.1), loss_type=[dpo.get("loss_type", "sigmoid")],
            label_smoothing=dpo.get("label_smoothing", 0.0), max_length=cfg["data"]["seq_len"] + 1,
        )
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                             callbacks=[Capture()])
        trainer.train()
    assert len(logged) == steps, logged
    return logged
