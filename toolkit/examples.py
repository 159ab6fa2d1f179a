"""Small synthetic tasks a tiny model learns in a few hundred steps, on the same prompts:

    reverse            {"prompt": "123456=", "response": "654321"}   (the quick start)
    reverse-plus-one   {"prompt": "123456=", "response": "765432"}   (reversed, each digit + 1 mod 10:
                                                                       the quick start's LoRA task)

Measured (../shared/reference/README.md): a tiny Llama reaches ~94% exact match on `reverse` after 400 steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DIGITS_PER_PROMPT = 6


N_TRAIN, N_VALID = 4000, 200
REQUIRED_ACCURACY = 0.9  # the held-out exact match the quick start asks of each task it teaches (~94% measured above)

TASKS = {
    "reverse": lambda digits: digits[::-1],
    "reverse-plus-one": lambda digits: "".join(str((int(d) + 1) % 10) for d in digits[::-1]),
}


def reversal_split(n_train: int = N_TRAIN, n_valid: int = N_VALID, seed: int = 0, task: str = "reverse"):
    """(train pairs, held-out pairs): distinct digit strings, so no held-out prompt was trained on."""
    numbers = random.Random(seed).sample(range(10**DIGITS_PER_PROMPT), n_train + n_valid)
    answer = TASKS[task]
    pairs = [(f"{n:0{DIGITS_PER_PROMPT}d}=", answer(f"{n:0{DIGITS_PER_PROMPT}d}")) for n in numbers]
    return pairs[:n_train], pairs[n_train:]


def write_reversal_task(directory: str | Path, seed: int = 0, task: str = "reverse") -> tuple[Path, Path, list[tuple[str, str]]]:
    """train.jsonl and valid.jsonl in `directory`; also returns the held-out pairs."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, valid = reversal_split(seed=seed, task=task)
    paths = (directory / "train.jsonl", directory / "valid.jsonl")
    for path, chunk in zip(paths, (train, valid)):
        path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in chunk))
    return paths[0], paths[1], valid


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


def write_preference_task(directory: str | Path, n_train: int = 512, n_valid: int = 64, seed: int = 0) -> tuple[Path, Path, list[dict]]:
    """method=dpo's example: the same prompts, the reversed digits preferred to the digits copied
    ({"prompt": "123456=", "chosen": "654321", "rejected": "123456"}). A random model likes either
    about equally; DPO learns the preference, which holds on prompts it never saw.
    train.jsonl and valid.jsonl in `directory`; also returns the held-out records."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, valid = reversal_split(n_train, n_valid, seed)
    paths = (directory / "train.jsonl", directory / "valid.jsonl")
    chunks = [[{"prompt": p, "chosen": r, "rejected": p[:-1]} for p, r in chunk] for chunk in (train, valid)]
    for path, chunk in zip(paths, chunks):
        path.write_text("".join(json.dumps(record) + "\n" for record in chunk))
    return paths[0], paths[1], chunks[1]


def preference_accuracy(hf_dir: str | Path, records: list[dict], reference: str | Path | None = None) -> float:
    """Share of records whose chosen completion the HF model at hf_dir scores higher than the rejected
    one (summed log-probabilities, plain transformers); with `reference`, minus that model's scores
    (DPO's implicit reward, TRL's rewards/accuracies)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.train.preference import parse_pair

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)

    def scores(model_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        out = []
        for record in records:
            pair = parse_pair(tokenizer, record)
            logps = []
            for completion in (pair.chosen, pair.rejected):
                ids = torch.tensor([pair.prompt + completion])
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0, :-1].float()
                token_logps = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
                logps.append(float(token_logps[len(pair.prompt) - 1:].sum()))
            out.append(logps)
        return out

    policy = scores(hf_dir)
    if reference is not None:
        policy = [[c - rc, r - rr] for (c, r), (rc, rr) in zip(policy, scores(reference))]
    return sum(c > r for c, r in policy) / len(policy)
