"""megatron-core, loading our checkpoints on several gloo processes, reproduces the HF model.

The HF `transformers` model is the independent implementation: each launch converts every
family in both formats for one layout and compares logits (true vocab) and every layer's output
within 1e-4 in fp32. One launch per layout, because process start-up dominates.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.convert import hf_to_megatron
from toolkit.convert.metadata import CheckpointMeta
from toolkit.convert.parity import verify_many
from toolkit.memory.params import stage_param_numels
from toolkit.runtime.launch import run_on_processes
from tests.conftest import FEWER_KV_HEADS_THAN_TP2, VARIANTS

FP32_TOLERANCE = 1e-4
FAMILIES_CHECKED_NATIVELY = ("llama", "qwen3", "phi4-mini", "gemma3", "olmo2")


def convert_all(tiny_hf, tmp_path, tp, pp, variants=VARIANTS):
    pairs = []
    for variant in variants:
        for fmt in ("torch", "torch_dist"):
            out = hf_to_megatron(tiny_hf[variant], tmp_path / f"{variant}-{fmt}", tp=tp, pp=pp, fmt=fmt, progress=False)
            pairs.append((tiny_hf[variant], out))
    return pairs


def assert_parity(reports):
    for report in reports:
        assert not report.bad_files, report.checkpoint
        assert report.max_logit_diff < FP32_TOLERANCE, "\n".join(report.lines())
        assert max(report.layer_diffs) < FP32_TOLERANCE, "\n".join(report.lines())
        assert report.top1_agreement == 1.0, report.checkpoint


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "tp, pp, extra",
    [(2, 1, FEWER_KV_HEADS_THAN_TP2), (1, 2, ()), (2, 2, ()), (1, 3, ()), (4, 1, ())],
    ids=["TP2-incl-1kv-head", "PP2-incl-tied", "TP2xPP2", "PP3", "TP4-2kv-heads"],
)
def test_logits_match_hf_for_every_family_and_format(tiny_hf, tmp_path, tp, pp, extra):
    """At TP2 also Qwen3 and Phi-3 with one KV head: megatron-core all-gathers the fused QKV and
    re-slices it, so each rank's shard holds half of the one query group (Phi-3's from its fused
    qkv_proj)."""
    pairs = convert_all(tiny_hf, tmp_path, tp, pp, VARIANTS + extra)
    for _, out in pairs[2 * len(VARIANTS):]:
        assert CheckpointMeta.read(out).model_spec.num_kv_heads < tp
    assert_parity(verify_many(pairs))


@pytest.mark.multiprocess
def test_checkpoints_written_at_tp2_pp2_load_at_tp1_pp1(tiny_hf, tmp_path, copy_everything):
    """torch_dist through megatron-core's own loader; per-rank torch files through our in-memory reshard.
    Written with every shard's byte ranges copied file to file (q/k/v groups, row-parallel rows)."""
    pairs = [
        (tiny_hf[v], hf_to_megatron(tiny_hf[v], tmp_path / f"{v}-{fmt}", tp=2, pp=2, fmt=fmt, progress=False))
        for v in VARIANTS
        for fmt in ("torch_dist", "torch")
    ]
    assert copy_everything
    assert_parity(verify_many(pairs, tp=1, pp=1))


@pytest.mark.multiprocess
def test_layout_agrees_with_megatron_core_itself(tiny_hf, tmp_path):
    """For Llama, Qwen3 (q/k norms, head_dim != hidden / heads), Phi-4-mini (fused HF tensors,
    partial rotary, tied), Gemma 3 and OLMo 2 (the toolkit's block spec: post-norms,
    whole-projection q/k norms): our torch_dist output loads at TP1 x PP1 through megatron-core's
    own loader, and megatron-core writes back the same layout."""
    cases = [
        {
            "dist": str(hf_to_megatron(tiny_hf[f"{family}-fp32"], tmp_path / f"{family}-dist", tp=2, pp=2,
                                       fmt="torch_dist", progress=False)),
            "bf16_dist": str(hf_to_megatron(tiny_hf[family], tmp_path / f"{family}-bf16", tp=2, pp=2,
                                            fmt="torch_dist", progress=False)),
            "te_torch": str(hf_to_megatron(tiny_hf[family], tmp_path / f"{family}-te", fmt="torch", layer_spec="te",
                                           progress=False)),
            "resave": str(tmp_path / f"{family}-resaved"),
        }
        for family in FAMILIES_CHECKED_NATIVELY
    ]
    (results,) = run_on_processes("tests.mp_workers:megatron_native_checks", 1, cases)
    for family, case, result in zip(FAMILIES_CHECKED_NATIVELY, cases, results):
        # `toolkit memory` counts the parameters from the same family table (q/k norms included).
        spec = CheckpointMeta.read(Path(case["dist"])).model_spec
        assert sorted(stage_param_numels(spec, 1, 1, 0)) == result["param_numels"], family
        # TE-named torch keys == the keys megatron-core's local spec uses in sharded_state_dict(), layer index aside.
        ours = {re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", k) for k in result["te_keys"]}
        assert ours == set(result["sharded_keys"]), family

        # Our single-process torch_dist writer produces what megatron-core's own save produces,
        # dtypes included (an fp32 source and model: no fp32-norm exception on either side).
        assert result["ours"] == result["megatrons"], family
        assert {v[1] for v in result["ours"].values() if v != "bytes"} == {"torch.float32"}, family
        # From a bf16 source every tensor is stored bf16, as the HF files hold it.
        assert {v[1] for v in result["bf16_source"].values() if v != "bytes"} == {"torch.bfloat16"}, family
    by_family = {family: result["ours"] for family, result in zip(FAMILIES_CHECKED_NATIVELY, results)}
    qwen3, gemma3, olmo2 = by_family["qwen3"], by_family["gemma3"], by_family["olmo2"]
    assert qwen3["decoder.layers.self_attention.q_layernorm.weight"] == ((6, 12), "torch.float32")
    assert qwen3["decoder.layers.self_attention.linear_qkv.weight"][0] == (6, (12 + 2 * 2) * 12, 64)
    assert gemma3["decoder.layers.mlp.linear_fc2.post_layernorm.weight"] == ((6, 72), "torch.float32")
    assert "output_layer.weight" not in gemma3  # tied
    assert olmo2["decoder.layers.self_attention.q_layernorm.weight"] == ((6, 12 * 8), "torch.float32")
    assert olmo2["decoder.layers.self_attention.k_layernorm.weight"] == ((6, 2 * 8), "torch.float32")
    assert not any("layer_norm_weight" in k for k in olmo2)  # no pre-norms


def logit_change(hf_dir, **config_change) -> float:
    """Max |logit difference| on the parity test's tokens between the model and the model with
    `config_change`: a guard that the parity test would catch a converter that drops the feature."""
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens = reference_tokens(model.config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    changed = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **config_change)
    with torch.no_grad():
        return (model(tokens).logits - changed(tokens).logits).abs().max().item()


def test_sliding_window_changes_the_model_so_parity_proves_it(tiny_hf):
    """Mistral's window (8) is shorter than the parity sequences (32): without it logits differ."""
    assert logit_change(tiny_hf["mistral"], sliding_window=None) > 100 * FP32_TOLERANCE


def test_llama3_rope_scaling_changes_the_model_so_parity_proves_it(tiny_hf):
    """Dropping the llama3 scaling (rope_type default, same theta) moves the logits far past the
    tolerance on the parity test's 32 tokens (the tiny model's sharper attention, tinymodels.py)."""
    theta = json.loads((tiny_hf["llama3-scaled"] / "config.json").read_text())["rope_parameters"]["rope_theta"]
    unscaled = {"rope_type": "default", "rope_theta": theta}
    assert logit_change(tiny_hf["llama3-scaled"], rope_parameters=unscaled) > 100 * FP32_TOLERANCE


def test_qwen3_qk_norm_changes_the_model_so_parity_proves_it(tiny_hf):
    """Qwen3 with its per-head q/k RMSNorms switched off (identity) moves the logits far past the
    tolerance, so a converter that dropped them (or a model built without qk_layernorm) fails parity."""
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    tokens = reference_tokens(251, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf["qwen3"], dtype=torch.float32)
    with torch.no_grad():
        with_norms = model(tokens).logits
        for layer in model.model.layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
        without = model(tokens).logits
    assert (with_norms - without).abs().max().item() > 100 * FP32_TOLERANCE


@pytest.mark.multiprocess
def test_verify_cli_catches_a_tampered_shard_even_with_a_matching_checksum_and_reports_each_stage_once(tiny_hf, tmp_path):
    """Also: the stage lines (issue 9: verify was silent for ~17 s) come once each, from rank 0 only,
    and --cpu is stated."""
    from toolkit.checksum import file_digest
    from toolkit.convert.metadata import META_FILE
    from toolkit.convert.torch_format import load_trusted_types

    out = hf_to_megatron(tiny_hf["llama"], tmp_path / "m", tp=1, pp=2, progress=False)
    rank_file = out / "release" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = load_trusted_types(rank_file, mmap=False)
    weight = state["model"]["decoder.layers.1.mlp.linear_fc2.weight"]  # global layer 4
    weight[0, 0] += 0.5
    torch.save(state, rank_file)
    meta = json.loads((out / META_FILE).read_text())
    meta["checksums"]["release/mp_rank_00_001/model_optim_rng.pt"] = file_digest(rank_file)
    (out / META_FILE).write_text(json.dumps(meta))

    result = subprocess.run([sys.executable, "-m", "toolkit", "convert", "verify", str(tiny_hf["llama"]), str(out),
                             "--cpu"], capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    stages = re.findall(r"^verify \[(\d)/5\] (.*)  \(\+[\d.]+ s\)$", result.stderr, re.MULTILINE)
    assert [int(i) for i, _ in stages] == [1, 2, 3, 4, 5], result.stderr
    assert stages[1][1].startswith("launching 2 processes (TP 1 x PP 2) on CPU (--cpu)")
    assert "first divergent   layer 4" in result.stdout
    assert "FAIL" in result.stdout and "checksum mismatch" not in result.stdout
    figure = float(re.search(r"max \|dlogit\|\s+(\S+)", result.stdout).group(1))
    assert figure > FP32_TOLERANCE


@pytest.mark.multiprocess
def test_verify_cli_fails_on_a_checksum_mismatch_alone(tiny_hf, tmp_path):
    """A changed value in a vocab padding row: logits over the true vocab are untouched, so only
    the checksum recorded at conversion can catch it."""
    from toolkit.convert.torch_format import load_trusted_types

    out = hf_to_megatron(tiny_hf["llama-odd-vocab"], tmp_path / "m", progress=False)  # vocab 250 padded to 256
    rel = "release/mp_rank_00/model_optim_rng.pt"
    state = load_trusted_types(out / rel, mmap=False)
    state["model"]["output_layer.weight"][-1, 0] = 1.0
    torch.save(state, out / rel)

    result = subprocess.run([sys.executable, "-m", "toolkit", "convert", "verify", str(tiny_hf["llama-odd-vocab"]),
                             str(out), "--no-progress"], capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert re.search(rf"checksum.*{re.escape(rel)}", output), output
