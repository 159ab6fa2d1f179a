"""`toolkit quickstart --lora`, its LoRA part (toolkit.quickstart_lora, steps 6-8): an adapter on a
model that already answers the quick start's task learns a second one on the same prompts.

The base here is the quick start's tiny Llama fine-tuned on `reverse` single-process in plain torch
(seconds; the quick start itself gets it from recipes/finetune.py at TP2 x PP2, which is not what
this test is about). The adapter is then trained by the real recipe, launched as the quick start launches
it, on one process (the quick start runs TP2 x PP2, whose LoRA parity tests/test_lora.py proves; at TP2 this
test took 110 s alone here against 78 s at TP1, 158 against 73 CPU seconds), merged, and asked the held-out prompts.
"""

from __future__ import annotations

import math

import pytest
import torch

# recipes/tiny-cpu.yaml's schedule: 300 steps of 64, warmup 20, cosine from 3e-3 to 3e-4, clipping at 1
BASE_STEPS, BASE_LR, BASE_MIN_LR, BASE_WARMUP, BASE_BATCH = 300, 3e-3, 3e-4, 20, 64


def recipe_lr(step: int) -> float:
    if step < BASE_WARMUP:
        return BASE_LR * (step + 1) / BASE_WARMUP
    progress = (step - BASE_WARMUP) / (BASE_STEPS - BASE_WARMUP)
    return BASE_MIN_LR + (BASE_LR - BASE_MIN_LR) * (1 + math.cos(math.pi * progress)) / 2


def fine_tune_on_reverse(out):
    """The tiny quick-start Llama trained on `reverse` as the quick start's recipe does, in one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.examples import reversal_split
    from toolkit.quickstart import TINY
    from toolkit.tinymodels import make_tiny_model

    make_tiny_model("llama", out, dtype="float32", **TINY)
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    train, _ = reversal_split(task="reverse")
    rows = [tokenizer(p + r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p, r in train]
    tokens = torch.tensor(rows)
    labels = tokens.clone()
    labels[:, : len(train[0][0])] = -100  # the prompt is not trained on
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for step in range(BASE_STEPS):
        pick = torch.randint(0, len(rows), (BASE_BATCH,), generator=generator)
        model(input_ids=tokens[pick], labels=labels[pick]).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = recipe_lr(step)
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    return out


@pytest.mark.multiprocess
def test_lora_on_the_fine_tuned_model_learns_a_second_task_to_full_held_out_accuracy(tmp_path):
    from toolkit import quickstart_lora

    from toolkit.examples import exact_match, reversal_split

    base = fine_tune_on_reverse(tmp_path / "base")
    print(f"base: {exact_match(base, reversal_split(task='reverse')[1]):.1%} exact match on held-out 'reverse' prompts")
    lines = []
    accuracy = quickstart_lora.run(tmp_path / "work", base, tp=1, pp=1, log=lines.append)
    print("\n".join(lines))
    assert "0.0% before the adapter" in lines[-1]  # the base does not already answer the second task
    assert accuracy >= 0.99, lines[-1]  # measured 100% (README, quick start)
