"""The independent reference a megatron-core run is judged against: the unconverted HF model,
trained in one process with torch.optim.AdamW over the same global batches in the same order.

It shares nothing with the trainer under test (toolkit/train/step.py, loss.py, build.py, data.py,
schedule.py): its own reading and tokenisation of the JSONL records (chat ones rendered by the
tokenizer's template, looked up by name with toolkit.train.chat_templates when the recipe names
one), its own packing, one forward per document (no padding, positions from 0), its own LR formula. The tests prove the trainer with
it on every layout; `toolkit parity` runs it on a user's model and data (toolkit/parity/check.py).

Its settings are the recipe's, as a mapping (the YAML, or TrainConfig.to_dict()): data.seq_len,
data.pack, data.truncation, data.overlong, data.columns, data.chat_template, optim.*, steps, global_batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import yaml

from toolkit.parity.tolerances import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32  # noqa: F401 - the tests' bars

ADAMW_BETAS = (0.9, 0.999)  # torch's and the recipe's defaults, when a recipe mapping leaves them out
ADAMW_EPS = 1e-8


def reference_lr_factor(step: int, warmup: int, total: int, floor: float, kind: str = "cosine") -> float:
    """Linear warmup, then cosine to `floor` (or constant), written out independently of
    toolkit.train.schedule: the factor of the base LR for the step after `step` completed ones."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    t = min(step - warmup, total - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2


def leading_special_tokens(tokenizer) -> list[int]:
    """The ids the tokenizer itself puts before a text (a BOS, or none), read off its own encoding
    with and without special tokens."""
    probe = "0"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start]
    return []


def encode_conversation(tokenizer, messages) -> tuple[list[int], list[int]]:
    """(tokens, targets mask) of a conversation rendered by the tokenizer's chat template one
    message longer at a time: the tokens an assistant message adds are its targets, the rest not."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the data has messages but the tokenizer has no chat template: set data.chat_template=FILE "
                         "(a Jinja template) or a name (chatml, llama3)")
    tokens, mask = [], []
    for end, message in enumerate(messages, 1):
        rendered = tokenizer.apply_chat_template(messages[:end], tokenize=True, add_generation_prompt=False)
        rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        mask += [int(message.get("role") == "assistant")] * (len(rendered) - len(tokens))
        tokens = rendered
    return tokens, mask


def encode_record(tokenizer, record: dict, columns: dict | None = None) -> tuple[list[int], list[int]]:
    """(tokens, targets mask) of one record: prompt (masked) + response + EOS, text + EOS (all
    counted), or messages (the assistant's tokens counted; the chat template ends the turns)."""
    names = {"prompt": "prompt", "response": "response", "text": "text", "messages": "messages", **(columns or {})}

    def encode(text) -> list[int]:
        return tokenizer(str(text), add_special_tokens=False)["input_ids"]

    if names["prompt"] in record and names["response"] in record:
        prompt = leading_special_tokens(tokenizer) + encode(record[names["prompt"]])
        response = encode(record[names["response"]]) + [tokenizer.eos_token_id]
        return prompt + response, [0] * len(prompt) + [1] * len(response)
    if names["messages"] in record:
        return encode_conversation(tokenizer, record[names["messages"]])
    if names["text"] in record:
        tokens = encode(record[names["text"]]) + [tokenizer.eos_token_id]
        return tokens, [1] * len(tokens)
    raise ValueError(f"the reference reads prompt/response, messages or text records, not {sorted(record)}")


def reference_tokenizer(hf_dir: Path, chat_template: str | None = None):
    """The HF model's tokenizer, with the recipe's data.chat_template (a file or a name) when it sets one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if chat_template is not None:
        from toolkit.train.chat_templates import template_text  # the user's setting looked up, nothing rendered

        tokenizer.chat_template = template_text(chat_template)
    return tokenizer


def reference_samples(tokenizer, data: Path, max_tokens: int, truncation: str = "right", overlong: str = "truncate",
                      columns: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """(tokens, targets mask) per JSONL line, in file order: cut to `max_tokens` at the `truncation`
    side (or dropped with overlong="drop"); a sample left with no target after its first token is dropped."""
    samples = []
    for line in Path(data).read_text().splitlines():
        if not line.strip():
            continue
        tokens, mask = encode_record(tokenizer, json.loads(line), columns)
        if len(tokens) > max_tokens:
            if overlong == "drop":
                continue
            keep = slice(None, max_tokens) if truncation == "right" else slice(len(tokens) - max_tokens, None)
            tokens, mask = tokens[keep], mask[keep]
        if any(mask[1:]):  # the first token is never predicted
            samples.append((tokens, mask))
    return samples


def reference_rows(samples, length: int, pack: bool) -> list[list[tuple[list[int], list[int]]]]:
    """Each training row as its list of documents: one sample per row, or greedy packing in
    file order where a sample never spans two rows."""
    if not pack:
        return [[s] for s in samples]
    rows, current, used = [], [], 0
    for tokens, mask in samples:
        if used + len(tokens) > length:
            rows.append(current)
            current, used = [], 0
        current.append((tokens, mask))
        used += len(tokens)
    return rows + ([current] if current else [])


def peft_model(model, adapter_dir: Path):
    """HF PEFT's own LoRA on `model`: get_peft_model with the adapter's config, its weights loaded."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(adapter_dir)
    config.inference_mode = False  # save_pretrained stores True, which would freeze the adapter too
    peft = get_peft_model(model, config)
    result = set_peft_model_state_dict(peft, load_file(str(Path(adapter_dir) / "adapter_model.safetensors")))
    assert not result.unexpected_keys, result.unexpected_keys
    return peft


def load_without_dropout(hf_dir: Path):
    """The HF model in fp32 with every dropout rate of its config at 0, as megatron-core's model is
    built (toolkit/model.py): a rate left on would make the two runs draw different masks."""
    from transformers import AutoConfig

    from toolkit.families.hf_values import auto_causal_lm

    config = AutoConfig.from_pretrained(hf_dir)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return auto_causal_lm().from_pretrained(hf_dir, config=config, dtype=torch.float32)


def settings(cfg) -> dict:
    """The recipe as a mapping: a YAML path's contents, or the mapping itself."""
    return yaml.safe_load(Path(cfg).read_text()) if isinstance(cfg, (str, Path)) else cfg


def recipe_rows(hf_dir: Path, data: Path, data_cfg: dict) -> list[list[tuple[list[int], list[int]]]]:
    """The rows of a JSONL file as the recipe's `data` settings make them (reference_samples, reference_rows)."""
    tokenizer = reference_tokenizer(hf_dir, data_cfg.get("chat_template"))
    samples = reference_samples(tokenizer, data, data_cfg["seq_len"] + 1, data_cfg.get("truncation", "right"),
                                data_cfg.get("overlong", "truncate"), data_cfg.get("columns"))
    return reference_rows(samples, data_cfg["seq_len"] + 1, data_cfg.get("pack", False))


def hf_reference(hf_dir: Path, data: Path, cfg, steps: int, device: str = "cpu",
                 adapter: Path | None = None, step_loss=None, on_step=None,
                 prepare=None) -> tuple[list[float], list[float]]:
    """Single-process HF transformers + torch.optim.AdamW on the unconverted weights, over the
    same global batches: loss = sum of token losses over the global batch / its token count.
    `cfg`: the recipe (a YAML path or its mapping). Returns (losses, gradient norms before
    clipping), one per step. With `adapter` (an HF PEFT directory) the model is HF PEFT's LoRA
    from that adapter, and only its LoRA weights train.

    `step_loss(model, rows, cfg, device)` -> (objective to back-propagate, reported loss) replaces
    the per-document forward (tests/moe_reference.py: padded micro-batches with the router's
    auxiliary loss). `on_step(step, model)` is called after each optimizer step (step from 1), e.g.
    to keep weights. `prepare(model)` is called once before training (e.g. routers in fp64)."""
    cfg = settings(cfg)
    data_cfg, optim = cfg["data"], cfg["optim"]
    assert data_cfg.get("shuffle") is False, "the reference reads the file in order"
    rows = recipe_rows(hf_dir, data, data_cfg)
    model = load_without_dropout(hf_dir)
    if adapter is not None:
        model = peft_model(model, adapter)
    model = model.to(device).train()
    if prepare is not None:
        prepare(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trained = [p for _, p in named]
    # no weight decay on norms and biases, as transformers' Trainer: by name too, since HF stacks the
    # experts' biases into 2-D tensors (gpt-oss gate_up_proj_bias [experts, 2I]), 1-D per expert in megatron-core
    decay = [p for n, p in named if p.ndim > 1 and not n.endswith("bias")]
    no_decay = [p for n, p in named if p.ndim <= 1 or n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim.get("weight_decay", 0.0)},
                             {"params": no_decay, "weight_decay": 0.0}], lr=optim["lr"],
                            betas=tuple(optim.get("betas", ADAMW_BETAS)), eps=optim.get("eps", ADAMW_EPS))
    floor = optim.get("min_lr", 0.0) / optim["lr"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: reference_lr_factor(s, optim.get("warmup_steps", 0), cfg["steps"], floor,
                                           optim.get("schedule", "cosine")))
    clip = optim.get("clip_grad", 1.0) or math.inf  # 0: no clipping, the norm still measured
    batch = cfg["global_batch"]
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        global_rows = [rows[i % len(rows)] for i in range(step * batch, (step + 1) * batch)]
        objective, loss = (step_loss or document_loss)(model, global_rows, cfg, device)
        objective.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trained, clip)))
        opt.step()
        sched.step()
        losses.append(float(loss.detach()) if torch.is_tensor(loss) else float(loss))
        if on_step is not None:
            on_step(step + 1, model)
    return losses, norms


def document_loss(model, global_rows, cfg, device):
    """Sum of token losses over the global batch / its token count, one forward per document."""
    total, count = 0.0, 0
    for row in global_rows:
        for tokens, mask in row:
            logits = model(input_ids=torch.tensor([tokens], device=device)).logits[0, :-1].float()
            targets = torch.tensor(mask[1:], dtype=torch.float32, device=device)
            token_loss = torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:], device=device), reduction="none")
            total = total + (token_loss * targets).sum()
            count += int(targets.sum())
    loss = total / count
    return loss, loss


def differences(metrics: list[dict], ref_losses: list[float], ref_norms: list[float]) -> tuple[float, float]:
    """(max |loss - reference|, max |grad norm - reference| / max(1, reference)) over the logged steps,
    which must be steps 1, 2, ... and as many as the reference's."""
    assert [m["step"] for m in metrics] == list(range(1, len(ref_losses) + 1)), [m["step"] for m in metrics]
    loss = max(abs(m["loss"] - r) for m, r in zip(metrics, ref_losses))
    norm = max(abs(m["grad_norm"] - r) / max(1.0, r) for m, r in zip(metrics, ref_norms))
    return loss, norm
