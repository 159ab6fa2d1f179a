"""The model-state formulas reproduce the ZeRO paper's worked example, and the 1F1B rule."""

from __future__ import annotations

import pytest

from toolkit.dsconfig import Setup
from toolkit.memory.estimate import in_flight
from toolkit.memory.states import ZeroSettings, model_states

# Rajbhandari et al. 2019, Figure 1 / §5: a 7.5B-parameter model, DP 64, mixed-precision Adam:
# 120 GB (baseline), 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p), GB = 1e9 bytes.
PAPER = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_worked_example(stage):
    numels = [10_000_000] * 750  # 7.5B parameters in 10M-element tensors
    # The paper keeps full fp16 gradients under P_os: they accumulate over several backward
    # passes before the step, which is what DeepSpeed's ZeRO-1 does too.
    states = model_states(numels, 2, 64, ZeroSettings(stage, param_persistence_threshold=0), backward_calls=2)
    assert states.params + states.grads + states.optimizer == pytest.approx(PAPER[stage], rel=0.015)  # 1.875 -> "1.9"


def test_first_stage_holds_up_to_pp_micro_batches():
    setup = Setup(gpus=8, pp=4, micro_batch=1, global_batch=16, schedule="megatron")  # DP 2, 8 micro-batches
    assert [in_flight(setup, s) for s in range(4)] == [4, 3, 2, 1]
    few = Setup(gpus=8, pp=4, micro_batch=1, global_batch=4, schedule="megatron")  # 2 micro-batches
    assert [in_flight(few, s) for s in range(4)] == [2, 2, 2, 1]


def test_memory_table_of_a_tiny_model_uses_fitting_units(tmp_path, capsys):
    """Every row of a 64-wide model used to print as 0.00 GiB."""
    import json

    from toolkit.cli import main
    from toolkit.tinymodels import make_config

    (tmp_path / "config.json").write_text(json.dumps(make_config("llama").to_dict()))
    assert main(["memory", str(tmp_path), "--gpus", "2", "--zero", "1", "--kernels", "cpu", "--seq-len", "32",
                 "--gpu-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines()[2:]}
    assert rows["parameters"] == ["497.62", "KiB"]  # 254,784 parameters x 2 bytes (bf16)
    assert rows["runtime reserve (assumed)"] == ["0", "B"]  # CPU kernels: no CUDA context
    assert "0.00 GiB" not in out and "0.0 GiB of" not in out
    assert "fits: " in out and " MiB of 1.00 GiB" in out


def _tiny_moe_spec():
    from toolkit.families import spec_from_config
    from toolkit.tinymodels import make_config

    return spec_from_config(make_config("mixtral").to_dict())[1]  # 6 experts, top-2


def test_ep_splits_only_the_experts_and_keeps_their_optimizer_states_per_rank():
    """At DP4: EP2 holds half the experts (3 of 6) and partitions their states over the expert-DP
    group of 2, so the optimizer states per rank are those of EP1 (6 experts over 4 ranks) and only
    the expert weights and gradients shrink; the router and the attention stay whole."""
    from toolkit.memory import CPU_LOCAL, estimate
    from toolkit.memory.params import stage_param_numels

    spec = _tiny_moe_spec()
    setup = Setup(gpus=4, zero=2, precision="bf16", micro_batch=2, global_batch=8, schedule="megatron")
    ep1, ep2 = (estimate(spec, setup, 32, kernels=CPU_LOCAL, reserve=0, ep=ep).stages[0] for ep in (1, 2))
    experts, dense = (sum(stage_param_numels(spec, 1, 1, 0, 1, part)) for part in ("experts", "dense"))
    assert experts and dense and experts + dense == sum(stage_param_numels(spec, 1, 1, 0))
    assert ep1.states.params - ep2.states.params == 2 * experts // 2
    assert abs(ep1.states.optimizer - ep2.states.optimizer) <= 12 * 2  # partition rounding only
    assert ep1.activations == ep2.activations  # every rank's experts see tokens x top-k rows on average


@pytest.mark.parametrize("ep, zero, message", [(4, 1, "divide the number of experts"), (3, 1, "divide"),
                                               (2, 3, "ZeRO-3")])
def test_bad_expert_parallel_layouts_are_refused(ep, zero, message):
    from toolkit.errors import ConfigError
    from toolkit.memory import estimate

    setup = Setup(gpus=4, zero=zero, precision="bf16", micro_batch=1, global_batch=4)
    with pytest.raises(ConfigError, match=message):
        estimate(_tiny_moe_spec(), setup, 32, ep=ep)


def test_ep_on_a_dense_model_is_refused():
    from toolkit.errors import ConfigError
    from toolkit.families import spec_from_config
    from toolkit.memory import estimate
    from toolkit.tinymodels import make_config

    spec = spec_from_config(make_config("llama").to_dict())[1]
    with pytest.raises(ConfigError, match="no experts"):
        estimate(spec, Setup(gpus=4, zero=1, micro_batch=1, global_batch=4), 32, ep=2)


def test_plan_enumerates_ep_for_moe_models_only():
    from toolkit.memory import GIB
    from toolkit.plan import Cluster, plan

    moe = plan(_tiny_moe_spec(), Cluster(4, 80 * GIB, 4), seq_len=32, global_batch=16, allow_offload=False)
    layouts = {(c.setup.dp, c.setup.zero, c.memory.ep) for c in moe.ranked}
    assert {ep for _, _, ep in layouts} == {1, 2}  # 6 experts: EP 4 does not divide them
    assert all(ep == 1 for _, zero, ep in layouts if zero == 3) and all(dp % ep == 0 for dp, _, ep in layouts)
    assert any("EP2" in c.explain(moe.cluster) for c in moe.ranked)
    from toolkit.families import spec_from_config
    from toolkit.tinymodels import make_config

    dense = plan(spec_from_config(make_config("llama").to_dict())[1], Cluster(4, 80 * GIB, 4), seq_len=32,
                 global_batch=16, allow_offload=False)
    assert {c.memory.ep for c in dense.ranked} == {1}


def test_memory_cli_takes_ep(tmp_path, capsys):
    import json

    from toolkit.cli import main
    from toolkit.tinymodels import make_config

    (tmp_path / "config.json").write_text(json.dumps(make_config("mixtral").to_dict()))
    args = ["memory", str(tmp_path), "--gpus", "4", "--zero", "1", "--kernels", "cpu", "--seq-len", "32"]
    assert main(args + ["--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "x DP 4 (EP 2)" in out
