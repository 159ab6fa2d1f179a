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
