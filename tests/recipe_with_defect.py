"""The fine-tuning recipe with one defect put in on purpose, for guard tests, named by DEFECT:

* `no-tp-sum:<part>`: parameters whose name contains <part> (every one when it is empty) are left
  out of the TP sum of partial gradients (toolkit.train.parallel.partial_over_tp), so each TP rank
  keeps the gradient of its own tokens (sequence-parallel norms, routers) or heads (q/k norms).
  `no-tp-sum:.router.` is a small router-gradient bug, as a router weight that lost its
  `sequence_parallel` tag would have (tests/test_moe_finetune.py).
* `tp-sum:<part>`: parameters whose name contains <part> are summed over TP as if each rank held a part of one
  replicated gradient, as a gated delta net's output norm is: on a parameter split over TP (Mamba-2's gated norm,
  each rank its own groups) the sum mixes different ranks' slices (tests/test_family_nemotron_h.py).
* `loss-factor:<F>`: every micro-batch's loss is multiplied by F before backward
  (toolkit.train.loss.scaled_loss), a wrong loss scale: the gradients are F times the right ones,
  which Adam and clipping hide from the losses (tests/test_finetune_parity.py, tests/test_fp16.py).
* `cp-positions-from-zero`: under context parallelism every CP rank's RoPE positions start at 0
  (megatron-core's get_pos_emb_on_this_cp_rank replaced by the first s/CP positions): each rank's
  chunks rotated as if they began the sequence, the bug users of other trainers report.
* `cp-loss-mean`: the loss averaged over the CP ranks instead of summed (each micro-batch's loss
  divided by CP): every gradient CP times too small (tests/test_context_parallel.py).
* `cp-window-dropped`: under context parallelism the windowed layers attend to the whole causal
  past (the window left out of the mask over global positions, toolkit.blocks.context_parallel).

Patched here, in the worker, so the product has no test switch."""

import os
import runpy
from pathlib import Path

from toolkit.train import loss, parallel

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"


def leave_out_of_tp_sum(part: str) -> None:
    partial_over_tp = parallel.partial_over_tp
    parallel.partial_over_tp = lambda config, name, param: part not in name and partial_over_tp(config, name, param)


def put_into_tp_sum(part: str) -> None:
    partial_over_tp = parallel.partial_over_tp
    parallel.partial_over_tp = lambda config, name, param: part in name or partial_over_tp(config, name, param)


def scale_the_loss(factor: str) -> None:
    scaled_loss = loss.scaled_loss

    def scaled_by_factor(*args, **kwargs):
        scaled, total = scaled_loss(*args, **kwargs)
        return scaled * float(factor), total

    loss.scaled_loss = scaled_by_factor


def rope_positions_from_zero(_: str) -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    from toolkit.runtime import cpu_compat

    def first_positions(pos_emb, seq_dim, cp_group):
        return pos_emb.narrow(seq_dim, 0, pos_emb.shape[seq_dim] // cp_group.size())

    cpu_compat._PATCHES["context_parallel_rope"] = lambda: None  # it would put the right ones back
    rope_utils.get_pos_emb_on_this_cp_rank = rotary_pos_embedding.get_pos_emb_on_this_cp_rank = first_positions


def loss_mean_over_cp(_: str) -> None:
    from megatron.core import parallel_state as ps

    scaled_loss = loss.scaled_loss

    def averaged(*args, **kwargs):
        scaled, total = scaled_loss(*args, **kwargs)
        return scaled / ps.get_context_parallel_world_size(), total

    loss.scaled_loss = averaged


def window_dropped(_: str) -> None:
    from toolkit.blocks import context_parallel

    built = context_parallel.ContextParallelAttention.__init__

    def without_window(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.window = None

    context_parallel.ContextParallelAttention.__init__ = without_window


DEFECTS = {"no-tp-sum": leave_out_of_tp_sum, "tp-sum": put_into_tp_sum, "loss-factor": scale_the_loss, "cp-positions-from-zero": rope_positions_from_zero,
           "cp-loss-mean": loss_mean_over_cp, "cp-window-dropped": window_dropped}

if __name__ == "__main__":
    name, _, argument = os.environ["DEFECT"].partition(":")
    DEFECTS[name](argument)
    runpy.run_path(str(RECIPE), run_name="__main__")
