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
from dataclasses import dataclass
from pathlib import Path

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
    always; gpt-oss's: logits with a bias, top-k, softmax over those k) computes from its fp32 input
    and weight in fp64, as megatron-core's router then does (router_gating_linear in moe_router_dtype,
    the bias included); the chosen experts' weights go back to the experts in fp32. Its logits stay
    fp64 for the aux loss."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers, "no HF TopKRouter in the model"
    for router in routers:
        routing = _fp64_topk_then_softmax if type(router).__name__ == "GptOssTopKRouter" else _fp64_routing
        router.forward = types.MethodType(routing, router)


def _fp64_routing(router, hidden_states):
    logits = F.linear(hidden_states.reshape(-1, router.hidden_dim).double(), router.weight.double())
    top, chosen = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(hidden_states.dtype), chosen


def _fp64_topk_then_softmax(router, hidden_states):
    """GptOssTopKRouter.forward in fp64: its bias in the logits, the softmax over the top-k logits only."""
    logits = F.linear(hidden_states.reshape(-1, router.hidden_dim).double(), router.weight.double(),
                      router.bias.double())
    top, chosen = torch.topk(logits, router.top_k, dim=-1)
    return logits, torch.softmax(top, dim=-1).to(hidden_states.dtype), chosen


def gemma4_routers_in_fp64(model) -> None:
    """hf_reference's `prepare` for moe.router_dtype=fp64 on Gemma 4: Gemma4TextRouter with its logits, softmax,
    top-k and renormalisation in fp64, as megatron-core's router then (its input rms(x) * scale / sqrt(hidden) in
    fp32 on both sides), the per-expert scale applied to the chosen weights."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    def forward(self, hidden_states):
        x = self.norm(hidden_states) * self.scale * self.scalar_root_size
        probs = torch.softmax(F.linear(x.double(), self.proj.weight.double()), dim=-1)
        top, index = torch.topk(probs, self.config.top_k_experts, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True) * self.per_expert_scale.double()[index]
        return probs, top.to(hidden_states.dtype), index

    _replace_forward(model, Gemma4TextRouter, forward)


def llama4_routers_in_fp64(model) -> None:
    """hf_reference's `prepare` for moe.router_dtype=fp64 on Llama 4: Llama4Router's logits, top-k and sigmoid in
    fp64, as megatron-core's sigmoid router then; the scores (0 off the top-k) go back in fp32, its logits fp64."""
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.double(), self.weight.double())
        top, index = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
        return torch.sigmoid(scores).to(hidden_states.dtype), logits

    _replace_forward(model, Llama4Router, forward)


def _replace_forward(model, router_class, forward) -> None:
    routers = [m for m in model.modules() if isinstance(m, router_class)]
    assert routers, f"no {router_class.__name__} in the model"
    for router in routers:
        router.forward = types.MethodType(forward, router)


def moe_step_loss(pad_id: int, aux_loss: str = "megatron"):
    """tests.finetune_harness.hf_reference's `step_loss`: the global batch as the trainer's padded
    micro-batches (rows of seq_len + 1 tokens, inputs the first seq_len), one forward each, with the
    load-balancing loss of `aux_loss` ("megatron" or "hf", the recipe's moe.aux_loss)."""

    def step_loss(model, global_rows, cfg, device):
        seq_len, micro = cfg["data"]["seq_len"], cfg["micro_batch"]
        text = model.config.get_text_config()  # a multimodal wrapper's language model's (Qwen3-VL-MoE's text_config)
        coeff, topk = text.router_aux_loss_coef, text.num_experts_per_tok
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
    DeepSeek-V3, gpt-oss, Gemma 4 and Llama 4 as their recipes train them): one forward per document (every token of it
    is routed, as the trainer routes every non-padding input), and per step the tokens each HF router
    (…TopkRouter / …TopKRouter, returning (logits, weights, experts); Llama 4's) sent to each expert, in
    `.routing` as the trainer's tokens_per_expert of its MoE layers. Works on a PeftModel too."""
    counts: list = []

    def step_loss(model, global_rows, cfg, device):
        # (Gemma 4's Gemma4TextRouter too, its expert count in its config; Llama 4's Llama4Router, returning
        # (scores, logits), its experts the top_k of its logits)
        routers = [m for m in model.modules()
                   if type(m).__name__.lower().endswith(("topkrouter", "gemma4textrouter", "llama4router"))]
        experts = getattr(routers[0], "num_experts", None) or routers[0].config.num_experts
        routed = torch.zeros(len(routers), experts, dtype=torch.long)

        def count(n, router, _inputs, out):  # returns None: the router's output stays as it is
            chosen = out[1].topk(router.top_k, dim=-1).indices if len(out) == 2 else out[2]
            routed[n] += torch.bincount(chosen.flatten(), minlength=experts)

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


def pad_token_id(hf_dir) -> int:
    """The pad id the trainer pads micro-batches with: the tokenizer's pad token, else its EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@dataclass
class FamilyRun:
    """A family's fine-tune launched by family_finetune_parity, and its differences from the HF reference."""

    hf: Path  # the tiny HF model (fp32)
    data: Path
    cfg: Path  # the recipe
    metrics: list[dict]
    loss: float  # max |loss - HF| over the steps
    norm: float  # max relative gradient-norm difference
    step_loss: object  # the reference's step loss, with what it recorded (e.g. its routing per step)


def family_finetune_parity(tmp_path: Path, variant: str, nprocs: int, parallel: dict, step_loss_for,
                           moe: dict | None = None, prepare=None, on_step=None, export_hf: bool = False,
                           layer_spec: str = "te", make=None, **model) -> FamilyRun:
    """The recipe on a tiny fp32 `variant` (`model`: its config changes; `make(directory, **model)` builds it
    instead where given, e.g. a multimodal wrapper's maker), converted to torch_dist (with `layer_spec`'s parameter
    names), at
    `parallel` (ZeRO-1) on `nprocs` processes over uneven data, against the single-process HF
    reference of tests.finetune_harness.hf_reference with the family's step loss, `step_loss_for(hf
    directory)`, `prepare` and `on_step`, over STEPS steps. The caller asserts on the result (a guard reuses its
    model and data)."""
    from tests.finetune_harness import (STEPS, differences, hf_reference, launch, read_metrics, recipe,
                                        write_uneven_data)
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    size = dict(dtype="float32", vocab_size=250, **model)
    hf = make(tmp_path / "hf", **size) if make else make_tiny_model(variant, tmp_path / "hf", **size)
    mc = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False, layer_spec=layer_spec)
    data = write_uneven_data(tmp_path / "data.jsonl", 300)
    cfg = recipe(tmp_path, mc, data, parallel={"zero_stage": 1, **parallel}, moe=moe or {}, export_hf=export_hf)
    launch(nprocs, cfg)
    metrics = read_metrics(tmp_path / "run")
    step_loss = step_loss_for(hf)
    loss, norm = differences(metrics, *hf_reference(hf, data, cfg, STEPS, step_loss=step_loss, prepare=prepare,
                                                       on_step=on_step))
    return FamilyRun(hf, data, cfg, metrics, loss, norm, step_loss)


def weight_change_errors(original: dict, exported: dict, reference: dict) -> dict[str, float]:
    """Per HF tensor: |run's change - reference's change| / |reference's change| (L2) of its weights over
    a run, from the `original` HF weights to the run's `exported` ones and to the reference's."""
    errors = {}
    for name, before in original.items():
        change = reference[name] - before
        errors[name] = float(((exported[name] - before) - change).norm() / change.norm())
    return errors


def gated_delta_moe_parity(tmp_path: Path, variant: str, name: str) -> FamilyRun:
    """The TP2 x PP2 x DP2 x EP2 (sequence-parallel) fine-tune of a gated-delta-net MoE family (Qwen3-Next,
    Qwen3.5-MoE) against HF with fp64 routing, router_aux_loss_coef 0.1 and the HF export: losses and gradient
    norms within the fp32 bars, and every step's tokens per expert as HF's routers chose them."""
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS

    run = family_finetune_parity(tmp_path, variant, 8, {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                                 lambda hf: moe_step_loss(pad_token_id(hf)), moe={"router_dtype": "fp64"},
                                 prepare=route_in_fp64, export_hf=True, router_aux_loss_coef=0.1)
    print(f"{name} TP2xPP2xDP2xEP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in run.metrics] == run.step_loss.routing
    return run


def routers_without_renormalising(model, router_class) -> None:
    """Every `router_class` in HF's `model` (Qwen3.5-MoE's, Qwen3-VL-MoE's top-k router) gives the top-k
    softmax probabilities as they are, not renormalised over the k: a parity guard."""
    import torch

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, top.to(logits.dtype), index

    for module in model.modules():
        if isinstance(module, router_class):
            module.forward = forward.__get__(module)
