"""Sample generations at eval time: greedy continuations of a few validation prompts, for a W&B table.

The prompt of a validation row is its first document's tokens before the first trained token
(`loss_mask`), the reference is the rest of that document. Decoding is greedy, one full forward per
new token (no KV cache: a handful of short samples at eval time only), on every rank: TP ranks each
hold a slice of the vocabulary (gathered here before the argmax), and every DP rank runs the same
forwards so that ZeRO-3 / FSDP parameter gathers stay in step. Pipeline parallelism is refused by the
config (toolkit.train.config): only the last stage has logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COLUMNS = ["step", "prompt", "reference", "output"]
TABLE_KEY = "eval_samples"


@dataclass
class Prompt:
    prompt: list[int]
    reference: list[int]


def prompts_of(rows, count: int) -> list[Prompt]:
    """The first `count` validation rows that have a prompt (at least one token before the first target)."""
    out = []
    for row in rows:
        doc = [i for i, d in enumerate(row.doc_ids) if d == row.doc_ids[0]] if row.doc_ids else range(len(row.tokens))
        first_target = next((i for i in doc if i > 0 and row.loss_mask[i]), None)
        if first_target is None:
            continue
        out.append(Prompt(row.tokens[:first_target], [row.tokens[i] for i in doc if i >= first_target]))
        if len(out) == count:
            break
    return out


def _next_token(model, tokens: torch.Tensor, last: int, vocab_size: int) -> int:
    """argmax of the logits at position `last` over the true vocabulary (the padded columns left out)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
    logits = model(tokens, positions, None)  # [1, s, V/tp]: causal, so the tail padding never reaches `last`
    full = gather_from_tensor_model_parallel_region(logits[:, last].float().contiguous())
    return int(full[0, :vocab_size].argmax())


def greedy_decode(model, prompt: list[int], max_new: int, seq_len: int, vocab_size: int, eos_id: int | None,
                  pad_id: int, device) -> list[int]:
    """Up to `max_new` greedy tokens after `prompt` (stopping after eos), within the model's seq_len.
    Every forward has the training length, as sequence parallelism needs seq_len divisible by TP."""
    prompt = prompt[-(seq_len - 1):]  # room for at least one new token
    tokens = torch.full((1, seq_len), pad_id, dtype=torch.long, device=device)
    tokens[0, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    length, out = len(prompt), []
    while len(out) < max_new and length < seq_len:
        token = _next_token(model, tokens, length - 1, vocab_size)
        out.append(token)
        if token == eos_id:
            break
        tokens[0, length] = token
        length += 1
    return out


def sample_rows(model, prompts: list[Prompt], step: int, tokenizer, max_new: int, seq_len: int, vocab_size: int,
                device) -> list[list]:
    """The table's rows (the same on every rank; rank 0 logs them)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.eval()
    try:
        with torch.no_grad():
            outputs = [greedy_decode(model, p.prompt, max_new, seq_len, vocab_size, tokenizer.eos_token_id, pad_id,
                                     device) for p in prompts]
    finally:
        model.train()

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    return [[step, text(p.prompt), text(p.reference), text(o)] for p, o in zip(prompts, outputs)]


def wandb_table(rows: list[list]):
    import wandb

    return wandb.Table(columns=COLUMNS, data=rows)
