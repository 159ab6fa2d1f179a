"""Mixture-of-Experts families (Mixtral, Qwen3-MoE, Qwen2-MoE with its gated shared expert, OLMoE with
its whole-projection q/k norms) converted with expert parallelism, and the routers' load-balancing
loss in HF's form (toolkit/blocks/router_losses.py).

The HF model is the independent reference: megatron-core, loading our checkpoints on EP 2, TP 2 x
EP 2 and PP 2 x EP 2 gloo processes, gives its logits within 1e-4 in fp32; the router mapping is
guarded by a checkpoint converted with the wrong top-k renormalisation, which the same parity run
must fail. Round trips are bit-exact in both formats; megatron-core's own loader reads our
torch_dist output at EP 1 and writes back the same layout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import MOE_VARIANTS
from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE, assert_parity, logit_change
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.dist_format import TE_MOE_ALIASES
from toolkit.convert.metadata import CheckpointMeta
from toolkit.convert.parity import verify_many
from toolkit.convert.torch_format import load_trusted_types
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.memory.params import stage_param_numels
from toolkit.runtime.launch import run_on_processes
from toolkit.tinymodels import make_config

ROUND_TRIP_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2), (2, 1, 1)]


def spec_of(variant: str, **changes):
    return spec_from_config({**make_config(variant).to_dict(), **changes})[1]


def test_router_settings_reproduce_hf_routing():
    """Renormalised top-k (Mixtral; Qwen3-MoE with norm_topk_prob) is megatron-core's softmax over the
    top-k logits; without renormalising it is softmax first (pre_softmax). No scaling, no dropping."""
    expected = {"moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
                "moe_expert_capacity_factor": None, "moe_router_topk": 2}
    cases = ((spec_of("mixtral"), False, 6, 40, None), (spec_of("qwen3-moe"), False, 8, 36, None),
             (spec_of("qwen3-moe", norm_topk_prob=False), True, 8, 36, None), (spec_of("qwen2-moe"), True, 6, 36, 52),
             (spec_of("olmoe"), False, 8, 44, None))
    for spec, pre_softmax, experts, ffn, shared in cases:
        settings = settings_for(spec).transformer
        assert {k: settings[k] for k in {**expected, "moe_router_topk": spec.moe_topk}} == {
            **expected, "moe_router_topk": spec.moe_topk}
        assert settings["moe_router_pre_softmax"] is pre_softmax
        assert (settings["num_moe_experts"], settings["moe_ffn_hidden_size"]) == (experts, ffn)
        # Qwen2-MoE's shared expert: megatron-core's SharedExpertMLP, sigmoid-gated as HF's shared_expert_gate
        assert (settings["moe_shared_expert_intermediate_size"], settings["moe_shared_expert_gate"]) == (
            shared, shared is not None)
    assert "num_moe_experts" not in settings_for(spec_of("llama")).transformer


def test_megatron_core_shared_expert_gate_is_hf_sigmoid_gate():
    """megatron-core's SharedExpertMLP.forward (shared_experts.py:128-131) scales the MLP's output by
    sigmoid(x @ gate_weight.T), gate_weight [1, hidden], as HF's sigmoid(shared_expert_gate(x))."""
    import inspect

    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    source = inspect.getsource(SharedExpertMLP.forward)
    assert "torch.nn.functional.linear(hidden_states, self.gate_weight)" in source
    assert "torch.nn.functional.sigmoid(logits)" in source and "output = output * gate_score" in source


def test_shared_expert_and_its_gate_change_the_model_so_parity_proves_them(tiny_moe):
    """Qwen2-MoE's shared expert ungated (scale 1) or dropped moves logits far past the tolerance."""
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    model = AutoModelForCausalLM.from_pretrained(tiny_moe["qwen2-moe"], dtype=torch.float32)
    tokens = reference_tokens(model.config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    blocks = [layer.mlp for layer in model.model.layers]
    with torch.no_grad():
        logits = model(tokens).logits
        gates = [b.shared_expert_gate for b in blocks]
        for b in blocks:  # sigmoid(1e4) == 1: the shared expert ungated
            b.shared_expert_gate = torch.nn.Linear(model.config.hidden_size, 1).requires_grad_(False)
            b.shared_expert_gate.weight.zero_()
            b.shared_expert_gate.bias.fill_(1e4)
        ungated = (model(tokens).logits - logits).abs().max().item()
        for b, gate in zip(blocks, gates):
            b.shared_expert_gate = gate
            b.shared_expert.down_proj.weight.zero_()
        dropped = (model(tokens).logits - logits).abs().max().item()
    assert min(ungated, dropped) > 100 * FP32_TOLERANCE, (ungated, dropped)


def test_router_renormalisation_changes_the_model_so_parity_proves_it(tiny_moe):
    assert logit_change(tiny_moe["qwen3-moe"], norm_topk_prob=False) > 100 * FP32_TOLERANCE


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("variant", [f"{v}-bf16" for v in MOE_VARIANTS])
def test_round_trip_is_bit_exact_with_expert_parallelism(tiny_moe, tmp_path, variant, fmt):
    src = tiny_moe[variant]
    original = load_all(src)
    for tp, pp, ep in ROUND_TRIP_LAYOUTS:
        for layer_spec in ("te", "local") if fmt == "torch" else ("te",):
            tag = f"{tp}{pp}{ep}{layer_spec}"
            mcore = hf_to_megatron(src, tmp_path / f"m{tag}", tp=tp, pp=pp, ep=ep, fmt=fmt, layer_spec=layer_spec,
                                   progress=False)
            restored = load_all(megatron_to_hf(mcore, tmp_path / f"h{tag}", progress=False))
            assert set(restored) == set(original), tag
            for name, tensor in original.items():
                assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), (tag, name)


def test_torch_files_are_named_and_numbered_as_megatron_lm_saves_experts(tiny_moe, tmp_path):
    """mp_rank_TT[_PPP]_EEE directories (checkpointing.py get_checkpoint_name); an EP rank's experts
    numbered from 0; the router and every dense tensor the same in every EP rank's file; SequentialMLP
    names with the local spec, TE grouped-GEMM names (`linear_fc1.weight{i}`) with the TE spec."""
    src = tiny_moe["mixtral-bf16"]
    hf = load_all(src)
    local = hf_to_megatron(src, tmp_path / "local", ep=2, layer_spec="local", progress=False)
    te = hf_to_megatron(src, tmp_path / "te", pp=2, ep=2, progress=False)
    assert sorted(p.name for p in (local / "release").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert sorted(p.name for p in (te / "release").iterdir()) == [f"mp_rank_00_00{p}_00{e}" for p in (0, 1) for e in (0, 1)]

    files = [load_trusted_types(local / f"release/mp_rank_00_00{e}/model_optim_rng.pt")["model"] for e in (0, 1)]
    expert = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc2.weight"
    hf_down = "model.layers.1.block_sparse_moe.experts.{}.w2.weight"
    for ep_rank, state in enumerate(files):
        assert {k for k in state if ".local_experts." in k and "layers.1." in k and k.endswith("fc2.weight")} == {
            expert.format(i) for i in range(3)}
        for i in range(3):  # local expert i of EP rank r is global expert 3r + i
            assert torch.equal(state[expert.format(i)], hf[hf_down.format(3 * ep_rank + i)])
    dense = [k for k, v in files[0].items() if v is not None and ".experts." not in k]
    assert "decoder.layers.0.mlp.router.weight" in dense and "decoder.layers.0.pre_mlp_layernorm.weight" in dense
    assert all(torch.equal(files[0][k], files[1][k]) for k in dense)

    te_state = load_trusted_types(te / "release/mp_rank_00_001_001/model_optim_rng.pt")
    assert (te_state["args"].expert_model_parallel_size, te_state["args"].num_experts) == (2, 6)
    names = set(te_state["model"])
    assert {f"decoder.layers.1.mlp.experts.linear_fc1.weight{i}" for i in range(3)} <= names
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names  # TE: the MoE pre-MLP norm is its own module
    assert "decoder.layers.1.mlp.experts.linear_fc1._extra_state" in names
    assert not any(".local_experts." in n or "linear_fc1.layer_norm_weight" in n for n in names)


def _wrong_router_checkpoint(moe_copy, tmp_path, ep):
    """Qwen3-MoE's weights converted as if its top-2 probabilities were not renormalised."""
    src = moe_copy("qwen3-moe")
    edit_config(src, norm_topk_prob=False)
    return hf_to_megatron(src, tmp_path / "wrong-router", ep=ep, progress=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 2), (2, 1, 2), (1, 2, 2)], ids=["EP2", "TP2xEP2", "PP2xEP2"])
def test_logits_match_hf_with_expert_parallelism(tiny_moe, moe_copy, tmp_path, tp, pp, ep):
    """Per-rank files written for this layout; torch_dist written at TP2 x PP2 x EP2 and resharded by
    megatron-core's loader. One launch per layout, every family and format in it."""
    pairs = []
    for variant in MOE_VARIANTS:
        for fmt, layout in (("torch", (tp, pp, ep)), ("torch_dist", (2, 2, 2))):
            out = hf_to_megatron(tiny_moe[variant], tmp_path / f"{variant}-{fmt}", tp=layout[0], pp=layout[1],
                                 ep=layout[2], fmt=fmt, progress=False)
            pairs.append((tiny_moe[variant], out))
    pairs.append((tiny_moe["qwen3-moe"], _wrong_router_checkpoint(moe_copy, tmp_path, ep)))
    *reports, wrong = verify_many(pairs, tp=tp, pp=pp, ep=ep)
    assert_parity(reports)
    print(f"TP{tp} PP{pp} EP{ep}", {r.checkpoint.rsplit("/", 1)[-1]: f"{r.max_logit_diff:.2e}" for r in [*reports, wrong]})
    assert wrong.max_logit_diff > 100 * FP32_TOLERANCE and not wrong.ok


@pytest.mark.multiprocess
def test_torch_dist_loads_at_ep1_through_megatron_core_and_is_its_own_layout(tiny_moe, tmp_path):
    """Written at TP2 x PP2 x EP2: megatron-core's dist_checkpointing loads it into a one-process model
    and saves the same tensors (keys, global shapes, dtypes) and objects back; the loaded model gives
    HF's logits (and the per-rank files, resharded by us, too)."""
    cases, pairs = [], []
    for variant in MOE_VARIANTS:
        convert = lambda name, src=tiny_moe[variant], **kw: hf_to_megatron(  # noqa: E731
            src, tmp_path / f"{variant}-{name}", progress=False, **kw)
        dist = convert("dist", tp=2, pp=2, ep=2, fmt="torch_dist")
        cases.append({"dist": str(dist), "te_torch": str(convert("te", layer_spec="te")),
                      "bf16_dist": str(convert("bf16", src=tiny_moe[f"{variant}-bf16"], ep=2, fmt="torch_dist")),
                      "resave": str(tmp_path / f"{variant}-resaved")})
        pairs += [(tiny_moe[variant], dist), (tiny_moe[variant], convert("torch", tp=2, pp=2, ep=2))]
    (results,) = run_on_processes("tests.mp_workers:megatron_native_checks", 1, cases)
    for variant, case, result in zip(MOE_VARIANTS, cases, results):
        # the same, plus the pre-MLP norm under the key the TE spec's MoE layer uses (TE_MOE_ALIASES)
        ((local_key, te_key),) = TE_MOE_ALIASES.items()
        assert result["ours"] == {**result["megatrons"], te_key: result["megatrons"][local_key]}, variant
        # `toolkit memory` counts parameters from the same family table, router and experts included
        spec = CheckpointMeta.read(Path(case["dist"])).model_spec
        assert sorted(stage_param_numels(spec, 1, 1, 0)) == result["param_numels"], variant
        ours = {re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", k) for k in result["te_keys"]}
        assert "decoder.layers.mlp.router.weight" in ours and "decoder.layers.mlp.router.weight" in result["sharded_keys"]
        assert {v[1] for v in result["bf16_source"].values() if v != "bytes"} == {"torch.bfloat16"}, variant
    mixtral = results[0]["ours"]
    assert mixtral["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == ((4, 6, 80, 72), "torch.float32")
    assert mixtral["decoder.layers.mlp.router.weight"] == ((4, 6, 72), "torch.float32")
    assert_parity(verify_many(pairs, tp=1, pp=1, ep=1))


@pytest.mark.parametrize(
    "variant, changes, kwargs, line",
    [
        ("mixtral", {}, {"ep": 4}, "6 experts cannot be split evenly over --ep 4"),
        ("mixtral", {"num_experts_per_tok": 7}, {},
         "num_experts_per_tok=7 is more than the 6 experts (num_local_experts)"),
        ("mixtral", {"router_jitter_noise": 0.1}, {}, "mixtral with router_jitter_noise=0.1 cannot be mapped exactly"),
        # a config naming dense layers the weights hold as MoE ones (tests/test_moe_dense_layers.py converts them)
        ("qwen3-moe", {"mlp_only_layers": [1]}, {}, "tensor(s) missing from the checkpoint, e.g. 'model.layers.1.mlp."),
        ("qwen3-moe", {"mlp_only_layers": [0, 1, 2, 3]}, {}, "leave no Mixture-of-Experts layer"),
        ("qwen3-moe", {}, {"tp": 8}, "attention heads are not divisible by --tp 8"),
        ("qwen3-moe", {"moe_intermediate_size": 35}, {"tp": 2}, "the experts' FFN width 35 is not divisible by --tp 2"),
        ("qwen2-moe", {"decoder_sparse_step": 0}, {}, "decoder_sparse_step=0; expected a positive integer"),
        ("qwen2-moe", {"qkv_bias": False}, {}, "qwen2_moe with qkv_bias=False cannot be mapped exactly"),
        ("qwen2-moe", {"shared_expert_intermediate_size": 51}, {"tp": 2},
         "the shared expert's FFN width 51 is not divisible by --tp 2"),
        ("olmoe", {"clip_qkv": 8.0}, {}, "olmoe with clip_qkv=8.0 cannot be mapped exactly"),
    ],
    ids=["ep-not-dividing", "topk-over-experts", "jitter", "dense-layers-not-in-weights", "no-moe-layer", "tp",
         "expert-ffn-tp", "qwen2-moe-sparse-step-0", "qwen2-moe-no-qkv-bias", "shared-ffn-tp", "olmoe-clip-qkv"],
)
def test_bad_moe_input_is_refused_in_one_line_and_nothing_written(moe_copy, tmp_path, variant, changes, kwargs, line):
    src = moe_copy(variant)
    if changes:
        edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$", **kwargs)


def test_ep_on_a_dense_model_is_refused(hf_copy, tmp_path):
    convert_fails(hf_copy("llama"), tmp_path / "out", re.escape("--ep 2 needs a Mixture-of-Experts model"), ep=2)


@pytest.mark.parametrize("variant, ep, tp", [("qwen3-moe", 4, 2), ("qwen2-moe", 2, 2), ("olmoe", 4, 1)])
def test_cli_ep_flag(tiny_moe, tmp_path, variant, ep, tp):
    out = tmp_path / "m"
    result = subprocess.run([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(tiny_moe[variant]),
                             str(out), "--ep", str(ep), "--tp", str(tp), "--no-progress"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"TP={tp} PP=1 EP={ep} to {out}" in result.stdout
    assert len(list((out / "release").iterdir())) == ep * tp
    assert json.loads((out / "toolkit_checkpoint.json").read_text())["ep"] == ep


def test_cli_ep_not_dividing_the_experts_is_one_line_and_writes_nothing(tiny_moe, tmp_path):
    bad = subprocess.run([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(tiny_moe["qwen3-moe"]),
                          str(tmp_path / "bad"), "--ep", "3"], capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "8 experts cannot be split evenly over --ep 3" in bad.stderr and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 2), (1, 2, 2), (1, 2, 1)], ids=["TP2xEP2", "PP2xEP2", "PP2"])
def test_megatron_lm_moe_checkpoint_without_our_metadata_exports_with_hf_config(tiny_moe, tmp_path, tp, pp, ep):
    """Megatron-LM's mp_rank_TT_NNN means PP rank NNN, or EP rank NNN at PP 1: the files' own `args`
    tell which, so a checkpoint from Megatron-LM training (no toolkit metadata) exports exactly."""
    import shutil

    src = tiny_moe["qwen3-moe-bf16"]
    out = hf_to_megatron(src, tmp_path / "m", tp=tp, pp=pp, ep=ep, progress=False)
    (out / "toolkit_checkpoint.json").unlink()
    shutil.rmtree(out / "hf")
    back = megatron_to_hf(out, tmp_path / "h", hf_config=src / "config.json", progress=False)
    original, restored = load_all(src), load_all(back)
    assert set(original) == set(restored) and all(torch.equal(original[k], restored[k]) for k in original)


def test_torch_writer_reads_only_the_experts_of_the_rank_it_writes(tiny_moe, tmp_path, monkeypatch):
    """Streaming stays bounded: between two rank files the writer reads exactly that EP rank's
    experts from the HF files (and each at most once per layer and TP rank), never all of them.
    Rank files are written on several threads at once: the reads are followed per thread."""
    from toolkit.convert import range_copy, torch_format
    from toolkit.convert.hf_source import HFCheckpoint

    # every shard built, so that every tensor it needs is read (byte ranges copied are never read)
    monkeypatch.setattr(range_copy, "MIN_RANGE_BYTES", 1 << 62)
    events: list[tuple[int, str, str]] = []
    read, save = HFCheckpoint.read, torch_format.stream_rank_file
    monkeypatch.setattr(HFCheckpoint, "read", lambda self, name, *a, **k: events.append(
        (threading.get_ident(), "read", name)) or read(self, name, *a, **k))
    # The file is written as its tensors are built: "save" is recorded once it is complete.
    monkeypatch.setattr(torch_format, "stream_rank_file", lambda path, *a, **k: (save(path, *a, **k), events.append(
        (threading.get_ident(), "save", path.parent.name)))[0])
    hf_to_megatron(tiny_moe["mixtral-bf16"], tmp_path / "m", tp=2, ep=2, progress=False)

    experts_read: dict[int, set[int]] = {}
    saved = []
    for thread, kind, name in events:
        if kind == "read" and (m := re.search(r"\.experts\.(\d+)\.", name)):
            experts_read.setdefault(thread, set()).add(int(m.group(1)))
        elif kind == "save":
            ep_rank = int(name.rsplit("_", 1)[1])
            assert experts_read.pop(thread, set()) == set(range(3 * ep_rank, 3 * ep_rank + 3)), name
            saved.append(name)
    assert sorted(saved) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    reads = [n for _, k, n in events if k == "read" and ".experts." in n]
    assert len(reads) == 4 * 3 * 3 * 4  # layers x (w1, w2, w3) x local experts x files: each once


def test_qwen3_moe_hub_config_naming_num_experts_converts(moe_copy, tmp_path):
    """Hub Qwen3-MoE configs say `num_experts` (transformers 5 writes `num_local_experts`)."""
    src = moe_copy("qwen3-moe-bf16")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (src / "config.json").write_text(json.dumps(cfg))
    out = hf_to_megatron(src, tmp_path / "m", ep=4, progress=False)
    assert json.loads((out / "toolkit_checkpoint.json").read_text())["spec"]["num_experts"] == 8


@pytest.mark.multiprocess
def test_mixtral_fine_tune_at_dp2_without_expert_parallelism_matches_hf(tmp_path):
    """At EP 1 (experts replicated like dense weights) the trainer fine-tunes a MoE model at DP 2 step
    for step like the single-process HF reference, router load-balancing loss included
    (tests/moe_reference.py; expert parallelism: tests/test_moe_finetune.py)."""
    from transformers import AutoTokenizer

    from tests.finetune_harness import hf_reference, launch, read_metrics, recipe, write_uneven_data
    from tests.moe_reference import moe_step_loss
    from toolkit.tinymodels import make_tiny_model

    data = write_uneven_data(tmp_path / "data.jsonl", 300)
    hf = make_tiny_model("mixtral", tmp_path / "hf", dtype="float32", vocab_size=250)
    cfg = recipe(tmp_path, hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False), data,
                 parallel={"tp": 1, "pp": 1, "zero_stage": 1})
    launch(2, cfg)
    metrics = read_metrics(tmp_path / "run")
    tokenizer = AutoTokenizer.from_pretrained(hf)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ref_losses, ref_norms = hf_reference(hf, data, cfg, 10, step_loss=moe_step_loss(pad))
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert max(abs(m["loss"] - r) for m, r in zip(metrics, ref_losses)) < 1e-5, (metrics, ref_losses)
    assert all(abs(m["grad_norm"] - r) <= 1e-4 * max(1.0, r) for m, r in zip(metrics, ref_norms))


@pytest.mark.multiprocess
def test_hf_aux_loss_matches_hf_output_router_logits(tiny_moe, tmp_path):
    """moe aux loss "hf": our megatron-core model's load-balancing loss (value, and the gradient of
    coeff * loss wrt every router weight) is HF's with output_router_logits=True on the same batch, within
    1e-6, for every MoE family, with and without activation recomputation, and with padding left out
    (HF's attention_mask, megatron-core's padding_mask); "megatron" is megatron-core's per-layer sum (its formula in README and
    toolkit/blocks/router_losses.py, evaluated on HF's router logits), far from HF's. One process, one launch."""
    from toolkit.blocks.router_losses import AuxLoss

    cases = [{"hf": str(tiny_moe[v]), "coeff": 0.02,
              "checkpoint": str(hf_to_megatron(tiny_moe[v], tmp_path / v, fmt="torch_dist", progress=False))}
             for v in MOE_VARIANTS]
    (results,) = run_on_processes("tests.mp_workers:moe_aux_loss_checks", 1, cases)
    for variant, r in zip(MOE_VARIANTS, results):
        print(variant, {k: f"{v:.3g}" for k, v in r.items()}, f"|hf - reference| {abs(r['hf'] - r['reference']):.1e}",
              f"padded {abs(r['hf_padded'] - r['padded_reference']):.1e}")
        for mode, reference in (("hf", "reference"), ("hf_recompute", "reference"), ("hf_padded", "padded_reference")):
            assert abs(r[mode] - r[reference]) < 1e-6 and r[f"{mode}_grad_diff"] < 1e-6 < r["grad_max"] * 1e-2, r
        assert abs(r["padded_reference"] - r["reference"]) > 1e-3  # the padding matters
        assert abs(r["megatron"] - r["megatron_formula"]) < 1e-6 * r["megatron"], (variant, r)
        assert abs(r["megatron"] - r["reference"]) > 0.1 and r["megatron_grad_diff"] > 100 * r["hf_grad_diff"], r
    assert AuxLoss("hf", 0.02).config_fields()["moe_aux_loss_coeff"] == 0.0  # megatron-core's own loss off


@pytest.mark.parametrize("aux, pp, line", [
    (("hf", 0.01), 2, "moe.aux_loss=hf with PP=2: HF's loss pools router counts over all layers of a forward"),
    (("switch", 0.01), 1, "moe.aux_loss='switch': choose one of megatron, hf"),
    (("megatron", -1.0), 1, "moe.aux_loss_coeff=-1.0: must be >= 0"),
], ids=["hf-at-pp2", "unknown-mode", "negative-coeff"])
def test_bad_aux_loss_setting_is_refused_in_one_line(aux, pp, line):
    from toolkit.errors import ConfigError
    from toolkit.blocks.router_losses import AuxLoss

    with pytest.raises(ConfigError, match=r"^" + re.escape(line) + r"[^\n]*$"):
        AuxLoss(*aux).check(pp)


def test_moe_fine_tune_with_tp_is_refused_in_one_line(tiny_moe, tmp_path):
    from tests.test_finetune_inputs import recipe_file
    from toolkit.errors import ToolkitError
    from toolkit.train import build
    from toolkit.train.config import load_config

    mc = hf_to_megatron(tiny_moe["qwen3-moe-bf16"], tmp_path / "mc", fmt="torch_dist", progress=False)
    cfg = load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["parallel.tp=2"])
    with pytest.raises(ToolkitError, match=r"^parallel.tp=2: fine-tuning a Mixture-of-Experts model \(qwen3_moe\) "
                                           r"with TP > 1 needs sequence parallelism[^\n]*$"):
        build.check_layout(cfg, 4, build.read_checkpoint_meta(cfg))
