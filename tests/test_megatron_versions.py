"""Checkpoints across the supported megatron-core releases (toolkit/runtime/megatron_versions.py).

The installed megatron-core is one end of the supported range; TOOLKIT_OTHER_MEGATRON_CORE names a
directory holding the other end (`pip install --no-deps --target DIR megatron-core==0.16.1`, which
.ci/run makes), put first on the PYTHONPATH of the processes that run under it. Between 0.18 and 0.19
the torch_dist layout moved (the common state went from common.pt into the DCP files), so each
direction is a different pair of writer and loader.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from tests.finetune_harness import copy_stopped_at_step_5, launch, read_metrics, recipe, write_uneven_data

OTHER = os.environ.get("TOOLKIT_OTHER_MEGATRON_CORE")


def _env(where: str) -> dict:
    """The environment of a process running under `where`: "installed" or "other"."""
    env = dict(os.environ)
    if where == "other":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (OTHER, env.get("PYTHONPATH")) if p)
    return env


def _version(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", "from megatron.core import package_info as p; print(p.__version__)"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


def _toolkit(env: dict, *args) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "toolkit", *map(str, args)], env={**env, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def ends():
    if not OTHER:
        reason = ("needs the other end of megatron-core's supported range beside the installed one: `pip install "
                  "--no-deps --target DIR megatron-core==0.16.1` and TOOLKIT_OTHER_MEGATRON_CORE=DIR (.ci/run does both)")
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI provides it, so this is a broken set-up, not a skip")
        pytest.skip(reason)
    versions = {where: _version(_env(where)) for where in ("installed", "other")}
    assert versions["installed"] != versions["other"], versions
    return versions


def test_the_installed_release_writes_the_common_state_where_its_loader_looks(tiny_hf, tmp_path):
    """The converter's torch_dist: common.pt up to 0.18, a `common_state` object inside the DCP files
    from 0.19 (what megatron-core's own save writes there); both read back by read_common_state."""
    from toolkit.convert import hf_to_megatron
    from toolkit.convert.torch_format import load_trusted_types
    from toolkit.runtime import megatron_versions

    out = hf_to_megatron(tiny_hf["llama"], tmp_path / "mc", fmt="torch_dist", progress=False)
    shards = next(p.parent for p in out.rglob("metadata.json") if (p.parent / ".metadata").is_file())
    assert megatron_versions.has_legacy_common(shards) == (not megatron_versions.common_state_in_dcp())
    common = megatron_versions.read_common_state(shards, lambda f: load_trusted_types(f, mmap=False))
    assert isinstance(common, dict)


@pytest.mark.multiprocess
@pytest.mark.parametrize("writer, reader", [("other", "installed"), ("installed", "other")])
def test_checkpoints_written_under_one_end_load_resume_and_export_under_the_other(ends, writer, reader, tmp_path):
    """Converted (torch_dist and torch) and trained under `writer`'s megatron-core; under `reader`'s the
    conversions verify against HF logits, the run resumes from its step-5 checkpoint with the
    uninterrupted run's losses and gradient norms, and its export is byte for byte the writer's."""
    from toolkit.tinymodels import make_tiny_model

    w, r = _env(writer), _env(reader)
    hf = make_tiny_model("llama", tmp_path / "hf", dtype="float32", num_hidden_layers=2, seed=3)
    data = write_uneven_data(tmp_path / "data.jsonl", 200)
    for fmt in ("torch_dist", "torch"):
        _toolkit(w, "convert", "hf-to-megatron", hf, tmp_path / fmt, "--format", fmt)
    straight = tmp_path / "straight"
    straight.mkdir()
    parallel = {"tp": 1, "pp": 1, "zero_stage": 1}
    launch(1, recipe(straight, tmp_path / "torch_dist", data, parallel=parallel, save_every=5), env=w)

    for fmt in ("torch_dist", "torch"):
        verdict = _toolkit(r, "convert", "verify", hf, tmp_path / fmt, "--cpu")
        assert "PASS" in verdict.stdout, verdict.stdout[-2000:]

    resumed = tmp_path / "resumed"
    copy_stopped_at_step_5(straight / "run", resumed)
    launch(1, recipe(resumed, tmp_path / "torch_dist", data, parallel=parallel, save_every=5), "resume=auto", env=r)
    before, after = read_metrics(straight / "run"), read_metrics(resumed / "run")
    assert [m["step"] for m in after] == list(range(1, 11))
    assert [m["loss"] for m in after[5:]] == pytest.approx([m["loss"] for m in before[5:]], rel=1e-6, abs=0)
    assert [m["grad_norm"] for m in after[5:]] == pytest.approx([m["grad_norm"] for m in before[5:]], rel=1e-6, abs=0)

    step = straight / "run" / "checkpoints" / "step_0000010"
    _toolkit(w, "convert", "megatron-to-hf", step, tmp_path / "hf-by-writer")
    _toolkit(r, "convert", "megatron-to-hf", step, tmp_path / "hf-by-reader")
    written = sorted(p.name for p in (tmp_path / "hf-by-writer").iterdir() if p.suffix == ".safetensors")
    _, differ, missing = filecmp.cmpfiles(tmp_path / "hf-by-writer", tmp_path / "hf-by-reader", written, shallow=False)
    assert written and not differ and not missing, f"the export differs between releases: {differ or missing}"
    info = _toolkit(r, "ckpt", "inspect", step).stdout
    layout = "common_state inside the DCP files" if Version(ends[writer]) >= Version("0.19") else "common.pt"
    assert f"torch_dist train/: non-tensor state in {layout}" in info, info


def test_starting_megatron_core_imports_no_mamba_layer():
    """What start-up patches (cpu_compat.apply, as init_parallel runs it) leaves megatron-core's Mamba mixer
    unimported: it is imported where a Mamba layer is built (megatron_versions.mamba_mixer_module). On 0.16.1
    it imports triton unguarded, which a CPU-only torch lacks: importing it at start-up failed every launch of
    CI's oldest lane (2026-12-02), for models without a Mamba layer too."""
    probe = ("import sys\nfrom toolkit.runtime import cpu_compat\ncpu_compat.apply()\n"
             "print('megatron' in sys.modules, 'megatron.core.ssm.mamba_mixer' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "True False", result.stdout


def test_a_mamba_layer_builds_or_says_in_one_line_that_it_needs_triton():
    """0.16.1 without triton (the oldest lane: a CPU-only torch) cannot import its Mamba mixer (see
    megatron_versions.CHANGES, 0.17.0): one line naming the fix. Every other case builds the layer's spec."""
    import importlib.util

    from toolkit.blocks import mixer_mamba
    from toolkit.errors import ToolkitError
    from toolkit.runtime import megatron_versions

    if importlib.util.find_spec("triton") is None and megatron_versions.series() < (0, 17):
        with pytest.raises(ToolkitError, match=r"imports triton, which is not installed.*pip install triton") as err:
            mixer_mamba.mamba_mixer_spec(4, 8)
        assert "\n" not in str(err.value)
        assert not megatron_versions.mamba_builds()  # what tests/test_published_parity.py leaves the Mamba pairs out by
    else:
        assert mixer_mamba.mamba_mixer_spec(4, 8).params == {"d_conv": 4, "chunk_size": 8}
        assert megatron_versions.mamba_builds()
