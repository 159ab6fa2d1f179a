"""The single-process HF reference of a vision-language fine-tune: transformers' Qwen3VLForConditionalGeneration
trained with torch.optim.AdamW over the recipe's global batches, in the data file's order.

It shares nothing with what is under test (toolkit/train/image_rows.py, vlm_data.py, model_inputs.py, toolkit/vlm/):
each record is rendered by the model's processor itself (AutoProcessor.apply_chat_template, the images opened by
transformers from their paths), the trained tokens found in the ids (each assistant turn, from its <|im_start|> to the
next), one forward per sample (no padding; HF's own MRoPE positions, image placement and DeepStack), the frozen parts
named by HF's module names. The LR formula is toolkit.parity.reference's, as every text parity test's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from toolkit.parity.reference import reference_lr_factor

# HF's names of Qwen3-VL's parts (LLaMA-Factory's: visual.patch_embed / visual.blocks, visual.merger)
HF_PARTS = {"vision": ("model.visual.patch_embed.", "model.visual.pos_embed.", "model.visual.blocks."),
            "projector": ("model.visual.merger.", "model.visual.deepstack_merger_list."),
            "language": ("model.language_model.", "lm_head.")}


def trained_mask(tokenizer, ids: list[int]) -> list[int]:
    """1 on each assistant turn, from its <|im_start|> to the next turn's (its <|im_end|> and newline included)."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    header = tokenizer.encode("assistant\n", add_special_tokens=False)
    starts = [i for i, t in enumerate(ids) if t == start] + [len(ids)]
    mask = [0] * len(ids)
    for a, b in zip(starts, starts[1:]):
        if ids[a + 1: a + 1 + len(header)] == header:
            mask[a:b] = [1] * (b - a)
    return mask


def _with_paths(messages: list[dict], images: list[str], directory: Path) -> list[dict]:
    """TRL's image parts with absolute paths, `<image>` placeholders taking the images column in order."""
    column = iter(images)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str) and "<image>" in content:
            pieces = content.split("<image>")
            content = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
            for piece in pieces[1:]:
                content.append({"type": "image", "image": None})
                if piece:
                    content.append({"type": "text", "text": piece})
        if isinstance(content, list):
            content = [{**p, "image": str(directory / (p.get("image") or next(column)))} if p["type"] == "image" else p
                       for p in content]
        out.append({"role": message["role"], "content": content})
    return out


def reference_samples(processor, data: Path) -> list[dict]:
    """Each record as the processor makes it (a batch of one): input_ids, pixel values, grids, token types; `mask`."""
    samples = []
    for line in data.read_text().splitlines():
        record = json.loads(line)
        messages = _with_paths(record["messages"], record.get("images", []), data.parent)
        sample = dict(processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt"))
        sample["mask"] = trained_mask(processor.tokenizer, sample["input_ids"][0].tolist())
        samples.append(sample)
    return samples


def sample_loss_sum(model, sample: dict) -> tuple[torch.Tensor, int]:
    """(sum of the sample's trained tokens' losses, their count): token i + 1 predicted from tokens up to i."""
    inputs = {k: v for k, v in sample.items() if k not in ("mask", "attention_mask")}
    logits = model(**inputs).logits[0, :-1].float()
    targets = torch.tensor(sample["mask"][1:], dtype=torch.float32)
    losses = torch.nn.functional.cross_entropy(logits, sample["input_ids"][0, 1:], reduction="none")
    return (losses * targets).sum(), int(targets.sum())


def hf_vlm_reference(hf_dir: Path, data: Path, cfg: dict, steps: int, freeze: list[str],
                     rows=None) -> tuple[list[float], list[float], float]:
    """(losses, gradient norms before clipping, one per step; the trained model's loss over every sample):
    loss = the token losses summed over their trained tokens' count, as the recipe's (a global batch's, or its
    evaluation's of a whole file). `rows`: the samples, else reference_samples of `data`."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    samples = rows if rows is not None else reference_samples(AutoProcessor.from_pretrained(str(hf_dir)), data)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32).train()
    frozen = tuple(prefix for part in freeze for prefix in HF_PARTS[part])
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optim = cfg["optim"]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if p.ndim > 1 and not n.endswith("bias")],
                              "weight_decay": optim["weight_decay"]},
                             {"params": [p for n, p in named if p.ndim <= 1 or n.endswith("bias")], "weight_decay": 0.0}],
                            lr=optim["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: reference_lr_factor(s, optim["warmup_steps"], cfg["steps"], 0.0, optim["schedule"]))
    batch = cfg["global_batch"]
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        sums = [sample_loss_sum(model, samples[i % len(samples)]) for i in range(step * batch, (step + 1) * batch)]
        count = sum(n for _, n in sums)
        loss = sum(total for total, _ in sums) / count
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], optim["clip_grad"] or math.inf)))
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        sums = [sample_loss_sum(model.eval(), sample) for sample in samples]
    return losses, norms, float(sum(total for total, _ in sums) / sum(n for _, n in sums))
