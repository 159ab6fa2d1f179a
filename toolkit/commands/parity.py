"""`toolkit parity`: a recipe's first steps on megatron-core against the HF model with torch AdamW."""

from __future__ import annotations

DESCRIPTION = """\
Does megatron-core train like HF on your model and data? Runs the first --steps steps of the recipe
twice: with recipes/finetune.py (megatron-core at the recipe's layout, on --nprocs local processes)
and with the HF model the checkpoint was converted from, trained by torch AdamW in one process, on
the same global batches in the same order. Both in fp32, the data in file order, no evaluation or
export. Prints the losses and gradient norms side by side and a verdict: PASS, or FAIL with the
first step and quantity that diverges and what it points at (the conversion when step 1's loss
differs, the training setup when only later steps do). Exit code 0 on PASS, 1 on FAIL.

The data must be one local JSONL file of prompt/response, messages or text records; the
reference must fit in one process (checked first, with toolkit memory's prices; if it does not,
the refusal names the --shrink-layers N whose copy of the model's first N layers fits). The
megatron-core run is written under a temporary directory, removed at the end (or kept in --workdir).
"""


def register(sub) -> None:
    import argparse

    from toolkit.parity.check import DEFAULT_STEPS
    from toolkit.parity.tolerances import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32

    p = sub.add_parser("parity", help="a recipe's first steps on megatron-core vs HF + torch AdamW, with a verdict",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the recipe YAML (its model.checkpoint: a converted checkpoint)")
    p.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides, e.g. parallel.tp=2 data.seq_len=512")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps to compare (default {DEFAULT_STEPS})")
    p.add_argument("--hf", help="the HF model the checkpoint was converted from (default: as its conversion recorded)")
    p.add_argument("--nprocs", type=int, help="processes of the megatron-core run (default TP x PP x EP, DP 1)")
    p.add_argument("--workdir", help="keep the megatron-core run in this new or empty directory (default: a temporary one)")
    p.add_argument("--loss-tolerance", type=float, default=LOSS_TOLERANCE_FP32,
                   help=f"largest |loss difference| that passes (default {LOSS_TOLERANCE_FP32:g})")
    p.add_argument("--norm-tolerance", type=float, default=GRAD_NORM_TOLERANCE,
                   help=f"largest relative gradient-norm difference that passes (default {GRAD_NORM_TOLERANCE:g})")
    p.add_argument("--shrink-layers", type=int, metavar="N",
                   help="compare on a copy of the HF model's first N layers (the rest of its config as it is), "
                        "converted again at the recipe's layout: for a model whose reference does not fit one process")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from toolkit.parity import ParityRequest, run_parity

    verdict = run_parity(ParityRequest(args.config, args.overrides, args.steps, args.hf, args.nprocs, args.workdir,
                                       args.loss_tolerance, args.norm_tolerance, shrink_layers=args.shrink_layers))
    return 0 if verdict.ok else 1
