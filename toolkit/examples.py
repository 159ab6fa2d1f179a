"""A small synthetic task a tiny model learns in a few hundred steps: reverse a digit string.

    {"prompt": "123456=", "response": "654321"}

Measured (../shared/reference/README.md): a tiny Llama reaches ~94% exact match after 400 steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DIGITS_PER_PROMPT = 6


def reversal_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(DIGITS_PER_PROMPT))
        out.append((digits + "=", digits[::-1]))
    return out


def write_reversal_task(directory: str | Path, n_train: int = 4000, n_valid: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and valid.jsonl (disjoint prompts) in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pairs = reversal_pairs(n_train + n_valid, seed)
    paths = (directory / "train.jsonl", directory / "valid.jsonl")
    for path, chunk in zip(paths, (pairs[:n_train], pairs[n_train:])):
        path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in chunk))
    return paths


def exact_match(hf_dir: str | Path, pairs: list[tuple[str, str]], batch: int = 100) -> float:
    """Fraction of prompts whose greedy continuation (up to EOS) is exactly the expected response."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    correct = 0
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=DIGITS_PER_PROMPT + 1,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for (_, expected), row in zip(chunk, out[:, ids.shape[1] :].tolist()):
            text = tokenizer.decode(row, skip_special_tokens=True).replace(" ", "")
            correct += text == expected
    return correct / len(pairs)
