"""The single-process HF reference of a Mixture-of-Experts fine-tune, with the router's auxiliary
(load-balancing) loss written out in megatron-core's per-layer form, independently of
megatron-core's code:

    per micro-batch m and layer l, over its T non-padding tokens (the trainer's padding_mask):
        aux(m, l) = coeff * E / (k * T^2) * sum_i P_i * c_i
    P_i the sum over tokens of the softmax score of expert i, c_i the tokens whose top-k holds i;
    the step's objective adds the mean over the global batch's micro-batches of sum_l aux(m, l)
    (megatron-core scales each micro-batch's aux gradient by 1 / micro-batches, DeepSpeed by 1 / DP).

With the recipe's moe.router_dtype=fp64 (megatron-core's moe_router_dtype), `route_in_fp64` makes
the reference's routers compute their logits, softmax, top-k and renormalisation in fp64 too.

HF's own load_balancing_loss_func differs (all layers pooled, no 1/k; see the README): the
trainer optimises it with moe.aux_loss=hf, and then the reference is HF's own: the micro-batch's
forward with output_router_logits=True and its attention mask (padding left out), whose
`aux_loss` the objective adds times router_aux_loss_coef, as HF's causal-LM loss does.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F


def megatron_aux_loss(router_logits: torch.Tensor, valid: torch.Tensor, coeff: float, topk: int) -> torch.Tensor:
    """One layer's load-balancing loss over one micro-batch's non-padding tokens ([T, E] router logits)."""
    router_logits = router_logits[valid]
    tokens, experts = router_logits.shape
    scores = torch.softmax(router_logits, dim=-1)
    routed = torch.zeros_like(scores).scatter(1, torch.topk(scores, topk, dim=1).indices, 1.0)
    return coeff * experts / (topk * tokens * tokens) * (scores.sum(0) * routed.sum(0)).sum()


def topk_margin(router_logits: torch.Tensor, valid: torch.Tensor, topk: int) -> float:
    """The smallest gap, over one layer's non-padding tokens, between a token's k-th and (k+1)-th
    router logit: how close its top-k choice came to a tie."""
    top = torch.topk(router_logits[valid], topk + 1, dim=1).values
    return float((top[:, topk - 1] - top[:, topk]).min())


def routed_counts(router_logits: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor:
    """Per expert, the non-padding tokens whose top-k holds it."""
    chosen = torch.topk(router_logits[valid], topk, dim=1).indices
    return torch.bincount(chosen.flatten(), minlength=router_logits.shape[1])


def route_in_fp64(model) -> None:
    """hf_reference's `prepare` for moe.router_dtype=fp64: every HF router (Mixtral's, Qwen2-MoE's,
    Qwen3-MoE's and OLMoE's TopKRouter: softmax, top-k, renormalised where norm_topk_prob, Mixtral
    always) computes from its fp32 input and weight in fp64, as megatron-core's router then does;
    the chosen experts' weights go back to the experts in fp32. Its logits stay fp64 for the aux loss."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers, "no HF TopKRouter in the model"
    for router in routers:
        router.forward = types.MethodType(_fp64_routing, router)


def _fp64_routing(router, hidden_states):
    logits = F.linear(hidden_states.reshape(-1, router.hidden_dim).double(), router.weight.double())
    top, chosen = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(hidden_states.dtype), chosen


def moe_step_loss(pad_id: int, aux_loss: str = "megatron"):
    """tests.finetune_harness.hf_reference's `step_loss`: the global batch as the trainer's padded
    micro-batches (rows of seq_len + 1 tokens, inputs the first seq_len), one forward each, with the
    load-balancing loss of `aux_loss` ("megatron" or "hf", the recipe's moe.aux_loss)."""

    def step_loss(model, global_rows, cfg, device):
        seq_len, micro = cfg["data"]["seq_len"], cfg["micro_batch"]
        coeff, topk = model.config.router_aux_loss_coef, model.config.num_experts_per_tok
        total, count, aux = 0.0, 0, 0.0
        margin, routing = float("inf"), None
        micro_batches = [global_rows[i : i + micro] for i in range(0, len(global_rows), micro)]
        for rows in micro_batches:
            (tokens, masks) = zip(*(row[0] for row in rows))  # unpacked: one document per row
            ids = torch.tensor([t + [pad_id] * (seq_len + 1 - len(t)) for t in tokens], device=device)
            mask = torch.tensor([m + [0] * (seq_len + 1 - len(m)) for m in masks], dtype=torch.float32, device=device)
            valid = torch.tensor([[j < len(t) for j in range(seq_len)] for t in tokens], device=device)
            out = model(input_ids=ids[:, :-1], attention_mask=valid.long() if aux_loss == "hf" else None,
                        output_router_logits=True)
            token_loss = F.cross_entropy(out.logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
            total = total + (token_loss * mask[:, 1:].flatten()).sum()
            count += int(mask[:, 1:].sum())
            margin = min(margin, *(topk_margin(layer, valid.flatten(), topk) for layer in out.router_logits))
            counts = torch.stack([routed_counts(layer, valid.flatten(), topk) for layer in out.router_logits])
            routing = counts if routing is None else routing + counts
            if aux_loss == "hf":
                aux = aux + coeff * out.aux_loss
            else:
                aux = aux + sum(megatron_aux_loss(layer, valid.flatten(), coeff, topk) for layer in out.router_logits)
        loss = total / count
        step_loss.margins.append(margin)
        step_loss.routing.append(routing.tolist())
        return loss + aux / len(micro_batches), loss

    step_loss.margins = []  # per step: the closest any token's top-k came to a tie (topk_margin)
    step_loss.routing = []  # per step: [layer][expert] non-padding tokens routed there (the trainer's tokens_per_expert)
    return step_loss


def routed_per_document():
    """hf_reference's `step_loss` for routers without a load-balancing loss in the objective (GLM-4.5,
    DeepSeek-V3 and gpt-oss as their recipes train them): one forward per document (every token of it
    is routed, as the trainer routes every non-padding input), and per step the tokens each HF router
    (…TopkRouter / …TopKRouter, returning (logits, weights, experts)) sent to each expert, in
    `.routing` as the trainer's tokens_per_expert of its MoE layers. Works on a PeftModel too."""
    counts: list = []

    def step_loss(model, global_rows, cfg, device):
        routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
        routed = torch.zeros(len(routers), routers[0].num_experts, dtype=torch.long)

        def count(n, router, _inputs, out):  # returns None: the router's output stays as it is
            routed[n] += torch.bincount(out[2].flatten(), minlength=router.num_experts)

        hooks = [router.register_forward_hook(functools.partial(count, n)) for n, router in enumerate(routers)]
        total, tokens = 0.0, 0
        for row in global_rows:
            for ids, mask in row:
                logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
                token_loss = F.cross_entropy(logits, torch.tensor(ids[1:], device=device), reduction="none")
                targets = torch.tensor(mask[1:], dtype=torch.float32, device=device)
                total, tokens = total + (token_loss * targets).sum(), tokens + int(targets.sum())
        for hook in hooks:
            hook.remove()
        counts.append(routed.tolist())
        return total / tokens, total / tokens

    step_loss.routing = counts
    return step_loss
