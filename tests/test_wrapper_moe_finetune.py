"""The MoE language models inside the vision-language checkpoints of 2026 (issue 40) fine-tune on text from the
wrapper's files and export back into the wrapper: GLM-4.6V (Glm46VForConditionalGeneration around GLM-4.5V's
glm4v_moe_text: GLM-4.5's router, groups, expert bias and shared experts without q/k norms, with an MRoPE) and
Kimi-K2.5 (Kimi_K25ForConditionalGeneration around DeepSeek-V3's language model) and Qwen3-VL-MoE
(Qwen3VLMoeForConditionalGeneration around Qwen3-MoE's, with MRoPE and its experts fused as published).

HF is the reference: the wrapper itself on text (one forward per document where no load-balancing loss trains),
10 fp32 steps, losses within 1e-5 and gradient norms within 1e-4 relative, every step's tokens per expert as HF's
routers chose them. At TP2 x EP2 with sequence parallelism (DP2 on 4 processes, expert TP 2): the pipeline split of a wrapper's language model
is the dense wrappers' (tests/test_finetune_parity.py), the routers' pieces keep their guards in
tests/test_family_glm4_moe.py and tests/test_family_deepseek_v3.py. The export back into the wrapper keeps every
other tensor's bytes and the multimodal class loads it."""

from __future__ import annotations

import json
from functools import partial

import pytest

from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS
from tests.moe_reference import family_finetune_parity, moe_step_loss, pad_token_id, route_in_fp64, routed_per_document
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.tinymodels import make_tiny_glm4v_multimodal, make_tiny_kimi_k25_multimodal, make_tiny_qwen3_vl_multimodal

# name: the tiny wrapper's maker, the layer spec its language model converts for, and the reference's step loss with
# what the recipe sets for it. GLM-4.6V's published text_config has router_aux_loss_coef 1e-4, which the recipe trains
# (as HF does with output_router_logits); here it is 0, so that the reference is the plain per-document loss (with
# it, the recipe's gradient norm is 1.6e-5 relative off a reference without it, and the routers' rows of experts no
# token chose train, moving later steps' routing). Qwen3-VL-MoE trains Qwen3-MoE's load-balancing loss
# (router_aux_loss_coef 0.1 here), routers in fp64 on both sides, as tests/test_moe_finetune.py's Qwen3-MoE.
PER_DOCUMENT = dict(step_loss_for=lambda hf: routed_per_document())
WITH_AUX_LOSS = dict(step_loss_for=lambda hf: moe_step_loss(pad_token_id(hf)), moe={"router_dtype": "fp64"},
                     prepare=route_in_fp64)
WRAPPERS = {
    "glm4.6v": (partial(make_tiny_glm4v_multimodal, glm46v=True, seed=81, router_aux_loss_coef=0.0), "te", PER_DOCUMENT),
    "kimi-k2.5": (partial(make_tiny_kimi_k25_multimodal, seed=82), "local", PER_DOCUMENT),
    "qwen3-vl-moe": (partial(make_tiny_qwen3_vl_multimodal, moe=True, seed=83, router_aux_loss_coef=0.1), "te",
                     WITH_AUX_LOSS),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(WRAPPERS))
def test_moe_wrapper_fine_tunes_at_tp2_ep2_as_hf_and_exports_back_into_the_wrapper(tmp_path, name):
    from transformers import AutoModelForImageTextToText

    from toolkit.convert import megatron_to_hf
    from toolkit.convert.wrapper import wrapper_for
    from toolkit.train.checkpoint import find_latest

    make, layer_spec, reference = WRAPPERS[name]
    run = family_finetune_parity(tmp_path, name, 4, {"tp": 2, "ep": 2, "sequence_parallel": True}, make=make,
                                 layer_spec=layer_spec, export_hf=True, **reference)
    print(f"{name} TP2xDP2xEP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    routing = [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in run.metrics]
    assert routing == [[layer for layer in step if any(layer)] for step in run.step_loss.routing]

    wrapper = wrapper_for(json.loads((run.hf / "config.json").read_text()))
    wrapped = megatron_to_hf(find_latest(tmp_path / "run") / "model", tmp_path / "wrapped", wrapper=run.hf,
                             progress=False)
    before, after, trained = tensor_hashes(run.hf), tensor_hashes(wrapped), tensor_hashes(tmp_path / "run" / "hf")
    language = {n: wrapper.text_name(n) for n in before if wrapper.text_name(n) is not None}
    other = [n for n in before if n not in language]
    assert after.keys() == before.keys() and other and all(after[n] == before[n] for n in other)
    # the language model's tensors as the text export wrote them; GLM-4.6V's experts are stored fused in its wrapper
    # (per expert in the text export): those are checked trained
    same_names = {n: t for n, t in language.items() if t in trained}
    assert {t: after[n] for n, t in same_names.items()} == {t: trained[t] for t in same_names.values()}
    changed = [n for n in language if after[n] != before[n]]
    assert any(".experts." in n for n in changed) and any("self_attn" in n for n in changed), "untrained"
    assert all(n in changed for n in language if ".experts." in n and n not in same_names)
    assert type(AutoModelForImageTextToText.from_pretrained(wrapped)).__name__ == wrapper.architecture
