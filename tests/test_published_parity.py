"""Checkpoints as published (issue 24), converted at TP2 x PP2 (x EP2 for MoE) and compared with
HF's logits in one launch of 8 processes, since process start-up dominates (the dense models run
with the EP ranks as data-parallel ranks): LongRoPE past and before its switch point (Phi-3,
Phi-4-mini); MoE models with dense layers (Qwen3-MoE's first two, Qwen2-MoE's every other one);
the multimodal Gemma 3's language model, against the wrapper's own text-only forward; GLM-4.5 with
its guards (tests/test_family_glm4_moe.py); gpt-oss with its guards, its experts at expert TP 1
(tests/test_family_gpt_oss.py); DeepSeek-V3 with its guards (tests/test_family_deepseek_v3.py); Qwen3-Next in
both formats (its guards in tests/test_family_qwen3_next.py); Qwen3.5 dense and MoE in both formats and both
wrappers' language models, the MoE ones with their experts stored fused too (its guards in
tests/test_family_qwen3_5.py); MiniMax-M2 in both formats, as published
in FP8 (against HF's model of the dequantized weights) and with its guard (tests/test_family_minimax_m2.py); Mistral 4
and Mistral Small 4's wrapper with its guards (tests/test_family_mistral4.py); Gemma 4 dense and MoE in both formats
and its wrapper's language model (its guards in tests/test_family_gemma4.py); Llama 4 and its wrapper (its guards
HF-side in tests/test_family_llama4.py); Qwen3-VL's dense and MoE wrappers in both formats, the MoE's experts as
published and as transformers saves them (its guards in tests/test_family_qwen3_vl.py); GLM-4.5V's wrapper in both
formats and GLM-4.6V's, its experts fused (its guards in tests/test_family_glm4v_moe.py); GLM-4.6V-Flash's dense
wrapper in both formats and GLM-4.1V's (its guards in tests/test_family_glm4v.py); Kimi-K2.5's wrapper in both
formats (tests/test_family_kimi_k25.py); Ministral 3 in both formats and inside the mistral3 wrapper
(tests/test_family_ministral3.py); OLMo-Hybrid in both formats and with its guards, three deliberately
wrong conversions (tests/test_family_olmo_hybrid.py); DeepSeek-V3.2's sparse attention in both formats and with its
guards (tests/test_family_deepseek_v32.py), GLM-5's in both formats (tests/test_family_glm_moe_dsa.py), and Nemotron 3
Nano 30B-A3B as published in both formats with its guards (tests/test_family_nemotron_h.py). On megatron-core 0.16.1
without triton (CI's oldest lane) the DSA and Mamba pairs are left out: their layers are refused there in one line."""

from __future__ import annotations

import pytest

from tests import test_family_deepseek_v3 as deepseek
from tests import test_family_deepseek_v32 as deepseek_v32
from tests import test_family_glm_moe_dsa as glm_moe_dsa
from tests.test_convert_parity import assert_parity
from tests import test_family_gemma4 as gemma4
from tests import test_family_glm4v as glm4v_dense
from tests import test_family_glm4v_moe as glm4v
from tests import test_family_gpt_oss as gpt_oss
from tests import test_family_kimi_k25 as kimi_k25
from tests import test_family_llama4 as llama4
from tests import test_family_minimax_m2 as minimax
from tests import test_family_ministral3 as ministral3
from tests import test_family_mistral4 as mistral4
from tests import test_family_nemotron_h as nemotron_h
from tests import test_family_olmo_hybrid as olmo_hybrid
from tests import test_family_qwen3_5 as qwen3_5
from tests import test_family_qwen3_next as qwen3_next
from tests import test_family_qwen3_vl as qwen3_vl
from tests.test_family_deepseek_v3 import tiny_deepseek  # noqa: F401  (fixture)
from tests.test_family_deepseek_v32 import tiny_deepseek_v32  # noqa: F401  (fixture)
from tests.test_family_glm_moe_dsa import tiny_glm_moe_dsa  # noqa: F401  (fixture)
from tests.test_family_gemma4 import tiny_gemma4  # noqa: F401  (fixture)
from tests.test_family_glm4_moe import assert_guards_fail, parity_pairs, tiny_glm  # noqa: F401  (fixtures)
from tests.test_family_glm4v import tiny_glm4v_dense  # noqa: F401  (fixtures)
from tests.test_family_glm4v_moe import tiny_glm4v  # noqa: F401  (fixtures)
from tests.test_family_gpt_oss import tiny_gpt_oss  # noqa: F401  (fixtures)
from tests.test_family_kimi_k25 import tiny_kimi_k25  # noqa: F401  (fixtures)
from tests.test_family_llama4 import tiny_llama4  # noqa: F401  (fixtures)
from tests.test_family_minimax_m2 import tiny_minimax  # noqa: F401  (fixtures)
from tests.test_family_ministral3 import tiny_ministral3  # noqa: F401  (fixtures)
from tests.test_family_mistral4 import tiny_mistral4  # noqa: F401  (fixtures)
from tests.test_family_olmo_hybrid import tiny_olmo_hybrid  # noqa: F401  (fixtures)
from tests.test_family_qwen3_5 import tiny_qwen3_5  # noqa: F401  (fixtures)
from tests.test_family_qwen3_next import tiny_qwen3_next  # noqa: F401  (fixtures)
from tests.test_family_qwen3_vl import tiny_qwen3_vl  # noqa: F401  (fixtures)
from tests.test_gemma3_wrapper import gemma3_wrapper  # noqa: F401
from tests.test_longrope import longrope_hf  # noqa: F401  (fixtures)
from tests.test_moe_dense_layers import DENSE_LAYER_VARIANTS, dense_layer_moe  # noqa: F401
from toolkit.convert import hf_to_megatron
from toolkit.convert.parity import verify_many
from toolkit.runtime import megatron_versions

FORMATS = ("torch", "torch_dist")


@pytest.mark.multiprocess
def test_published_variants_match_hf_at_tp2_pp2_ep2(longrope_hf, dense_layer_moe, gemma3_wrapper, tiny_glm,  # noqa: F811
                                                    tiny_gpt_oss, tiny_deepseek, tiny_qwen3_next,  # noqa: F811
                                                    tiny_qwen3_5, tiny_minimax, tiny_mistral4, tiny_gemma4,  # noqa: F811
                                                    tiny_llama4, tiny_qwen3_vl, tiny_glm4v, tiny_kimi_k25,  # noqa: F811
                                                    tiny_ministral3, tiny_glm4v_dense, tiny_olmo_hybrid,  # noqa: F811
                                                    tiny_deepseek_v32, tiny_glm_moe_dsa, tmp_path):  # noqa: F811
    sources = [*longrope_hf.values(), *(dense_layer_moe[v] for v in DENSE_LAYER_VARIANTS), gemma3_wrapper["fp32"]]
    pairs = []
    for i, src in enumerate(sources):
        fmt = FORMATS[i % 2]
        ep = 2 if "moe" in src.name else 1
        pairs.append((src, hf_to_megatron(src, tmp_path / f"{src.name}-{fmt}", tp=2, pp=2, ep=ep, fmt=fmt, progress=False)))
    glm, matching = parity_pairs(tiny_glm, tmp_path)
    oss, oss_matching = gpt_oss.parity_pairs(tiny_gpt_oss, tmp_path)
    ds, ds_matching = deepseek.parity_pairs(tiny_deepseek, tmp_path)
    m4, m4_matching = mistral4.parity_pairs(tiny_mistral4, tmp_path)
    q3n, _ = qwen3_next.parity_pairs(tiny_qwen3_next, tmp_path)  # all must match
    q35, _ = qwen3_5.parity_pairs(tiny_qwen3_5, tmp_path)  # all must match
    l4, _ = llama4.parity_pairs(tiny_llama4, tmp_path)  # all must match
    q3vl, _ = qwen3_vl.parity_pairs(tiny_qwen3_vl, tmp_path)  # all must match
    g4v, _ = glm4v.parity_pairs(tiny_glm4v, tmp_path)  # all must match
    g4vd, _ = glm4v_dense.parity_pairs(tiny_glm4v_dense, tmp_path)  # all must match
    k25, _ = kimi_k25.parity_pairs(tiny_kimi_k25, tmp_path)  # all must match
    mi3, _ = ministral3.parity_pairs(tiny_ministral3, tmp_path)  # all must match
    mm, mm_matching = minimax.parity_pairs(tiny_minimax, tmp_path)
    oh, oh_matching = olmo_hybrid.parity_pairs(tiny_olmo_hybrid, tmp_path)
    exact_dsa = megatron_versions.exact_dsa()  # refused before megatron-core 0.19 (CI's oldest lane)
    dsa, dsa_matching = deepseek_v32.parity_pairs(tiny_deepseek_v32, tmp_path) if exact_dsa else ([], 0)
    glm5 = glm_moe_dsa.parity_pairs(tiny_glm_moe_dsa, tmp_path)[0] if exact_dsa else []  # all must match
    g4, _ = gemma4.parity_pairs(tiny_gemma4, tmp_path)  # all must match
    mamba = megatron_versions.mamba_builds()  # not on megatron-core 0.16.1 without triton (CI's oldest lane)
    n3, n3_matching = nemotron_h.parity_pairs(tmp_path) if mamba else ([], 0)
    pairs += (q3n + q35 + g4 + l4 + q3vl + g4v + g4vd + k25 + mi3 + mm[:mm_matching] + oh[:oh_matching]
              + [minimax.fp8_parity_pair(tiny_minimax, tmp_path)] + dsa[:dsa_matching] + glm5 + n3[:n3_matching])
    reports = verify_many(pairs + glm + oss + ds + mm[mm_matching:] + m4 + oh[oh_matching:] + dsa[dsa_matching:]
                          + n3[n3_matching:], tp=2, pp=2, ep=2)
    n3_guards = reports[len(reports) - len(n3) + n3_matching:]
    reports = reports[:len(reports) - len(n3) + n3_matching]
    dsa_guards = reports[len(reports) - len(dsa) + dsa_matching:]
    reports = reports[:len(reports) - len(dsa) + dsa_matching]
    oh_guards = reports[len(reports) - len(oh) + oh_matching:]
    reports = reports[:len(reports) - len(oh) + oh_matching]
    glm_reports = reports[len(pairs):len(pairs) + len(glm)]
    oss_reports = reports[len(pairs) + len(glm):len(pairs) + len(glm) + len(oss)]
    ds_reports = reports[len(pairs) + len(glm) + len(oss):len(pairs) + len(glm) + len(oss) + len(ds)]
    mm_guards = reports[len(pairs) + len(glm) + len(oss) + len(ds):len(reports) - len(m4)]
    m4_reports = reports[len(reports) - len(m4):]
    assert_parity(reports[:len(pairs)] + glm_reports[:matching] + oss_reports[:oss_matching] + ds_reports[:ds_matching]
                  + m4_reports[:m4_matching])
    assert_guards_fail(glm_reports[matching:])
    gpt_oss.assert_guards_fail(oss_reports[oss_matching:])
    deepseek.assert_guards_fail(ds_reports[ds_matching:])
    minimax.assert_guards_fail(mm_guards)
    mistral4.assert_guards_fail(m4_reports[m4_matching:])
    olmo_hybrid.assert_guards_fail(oh_guards)
    if mamba:
        nemotron_h.assert_guards_fail(n3_guards)
    if exact_dsa:
        deepseek_v32.assert_guards_fail(dsa_guards)
