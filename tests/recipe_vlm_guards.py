"""The fine-tuning recipe run several times in one launch (tests/test_vlm_finetune.py): as it is, then each run named
by VLM_RUNS (comma-separated), into GUARD_ROOT/<name>/run: one step of each guard, with one piece of the
vision-language model broken on purpose,

* `mrope-1d`: the MRoPE positions computed as 1D (every token's T, H and W its text position);
* `image-rows-one-late`: the tower's rows (and DeepStack's) placed one token after the image tokens;
* `deepstack-dropped`: DeepStack's features never added after the first decoder layers;

or two steps of `projector-frozen`, the recipe as it is with vlm.freeze=vision,projector (the default), exported to
HF; or
`resumed`, the first run as if it had stopped after its step-5 checkpoint (save_every=5), resumed (resume=auto); or
three steps of `tp2-dp2`, the same ranks as TP2 x DP2.

Patched here, in the worker, so the product has no test switch. Each run ends megatron-core's groups, and the next
builds them again; the default process group is kept from the first run to the last (joined again, its rendezvous
would read the first one's addresses), and the checkpoint's save plan is made again for each."""

import contextlib
import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune.py"
sys.path.insert(0, str(REPO))  # launched as a script: tests.finetune_harness imports from the checkout (CI sets no PYTHONPATH)


def text_positions(token_types, image_grid_thw, spatial_merge_size, attention_mask=None):
    positions = torch.arange(token_types.shape[1], device=token_types.device)
    return positions.expand(3, *token_types.shape)


def rows_one_late(input_ids, image_token_id):
    return (input_ids == image_token_id).roll(1, 1)


def without_deepstack(self, index):
    return lambda module, args, output: output


ONE_STEP = ("steps=1",)
# name -> (what is patched, with what, the run's own settings)
RUNS = {"mrope-1d": ("toolkit.vlm.model.mrope_position_ids", text_positions, ONE_STEP),
        "image-rows-one-late": ("toolkit.vlm.model.image_token_mask", rows_one_late, ONE_STEP),
        "deepstack-dropped": ("toolkit.vlm.deepstack.DeepStack._hook", without_deepstack, ONE_STEP),
        "projector-frozen": (None, None, ("steps=2", "vlm.freeze=vision,projector", "export_hf=true")),
        "resumed": (None, None, ("resume=auto",)),
        "tp2-dp2": (None, None, ("steps=3", "parallel.tp=2", "parallel.pp=1"))}


def stopped_at_step_5(argv: list[str], run_dir: Path) -> None:
    """`run_dir`: a copy of the first run's as if it had stopped after its step-5 checkpoint (rank 0 copies)."""
    import torch.distributed as dist
    import yaml

    from tests.finetune_harness import copy_stopped_at_step_5

    if dist.get_rank() == 0:
        first = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())["run_dir"]
        copy_stopped_at_step_5(Path(first), run_dir.parent)
    dist.barrier()


def model_parallel_only() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> int:
    from toolkit.runtime import distributed
    from toolkit.train import torch_dist_save

    finetune = runpy.run_path(str(RECIPE), run_name="finetune_recipe")["main"]
    argv = sys.argv[1:]
    with mock.patch.object(distributed, "shutdown", model_parallel_only):
        code = finetune(argv)
        for name in filter(None, os.environ.get("VLM_RUNS", "").split(",")):
            target, replacement, settings = RUNS[name]
            torch_dist_save._strategy = None  # a process's save plan holds its first run's parameters
            run_dir = Path(os.environ["GUARD_ROOT"]) / name / "run"
            if name == "resumed":
                stopped_at_step_5(argv, run_dir)
            with mock.patch(target, replacement) if target else contextlib.nullcontext():
                code = code or finetune([*argv, *settings, f"run_dir={run_dir}"])
    distributed.shutdown()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
