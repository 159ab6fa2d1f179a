"""`toolkit slurm render|submit|status`: sbatch scripts for multi-node fine-tuning, and their jobs."""

from __future__ import annotations

import argparse
import sys

RENDER_HELP = """\
Write an sbatch script that runs recipes/finetune.py on every allocated node: one srun task per
node runs torchrun (--nnodes $SLURM_NNODES --node-rank $SLURM_NODEID, rendezvous at the first host
of `scontrol show hostnames`). It asks for USR1 SIGNAL_LEAD seconds before the time limit,
forwards it to the ranks, which checkpoint and stop, and requeues itself (at most MAX_RESTARTS
times); every start resumes from the latest complete checkpoint (resume=auto).

Every value is checked: #SBATCH fields against what they may hold, the rest shell-quoted.
--sbatch lines are raw by design (for options this command has no flag for): each must be one
--option[=value] without spaces or quotes, and may not override an option the script sets.
Secrets are never written: export WANDB_API_KEY / HF_TOKEN in the shell you submit from.

  toolkit slurm render recipes/llama-3.1-8b-full.yaml --nodes 1 --gpus-per-node 8 --time 12:00:00 \\
      --partition gpu -- data.train_file=train.jsonl

A GPU job from a recipe that keeps the tiny CPU example's data, run_dir or learning rate
(recipes/tiny-cpu.yaml) is refused until they are overridden.
"""


def register(sub) -> None:
    p = sub.add_parser("slurm", help="render, submit and inspect Slurm jobs for the fine-tuning recipe",
                       description="Render, submit and inspect Slurm jobs for the fine-tuning recipe.")
    inner = p.add_subparsers(dest="slurm_command", metavar="{render,submit,status}")
    # render/submit take recipe overrides among their options: their own parser runs
    # parse_intermixed_args on the rest of the command line ("+" keeps argparse off -h here).
    for name, helptext in (("render", "write an sbatch script"), ("submit", "write an sbatch script and sbatch it")):
        q = inner.add_parser(name, help=helptext, add_help=False, prefix_chars="+")
        q.add_argument("argv", nargs=argparse.REMAINDER)
        q.set_defaults(func=_render if name == "render" else _submit)
    s = inner.add_parser("status", help="state and last logged step of a job",
                         description="State (sacct, or scontrol show job without accounting) and the last logged step.")
    s.add_argument("job_id")
    s.add_argument("--run-dir", help="the run directory: read the last step from its metrics.jsonl "
                                     "(default: the trainer's lines in the job's log)")
    s.set_defaults(func=_status)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def job_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=RENDER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="recipe YAML (recipes/*.yaml)")
    p.add_argument("overrides", nargs="*", help="recipe overrides key.sub=value (put them after -- if any starts with -)")
    p.add_argument("-o", "--out", help="script path (default slurm/JOB_NAME.sbatch)")
    p.add_argument("--job-name", default="finetune")
    p.add_argument("--output", default="%x-%j.out", help="job log, sbatch patterns allowed (default %%x-%%j.out)")
    p.add_argument("--workdir", help="directory the job runs in; relative paths (here and in the recipe) resolve "
                                     "against it at render time (default: the current directory)")
    p.add_argument("--model", help="check the layout against this model (HF directory, config.json or converted "
                                   "checkpoint; default: the recipe's model.checkpoint where it exists here)")
    r = p.add_argument_group("resources")
    r.add_argument("--nodes", "--max-nodes", dest="nodes", type=int, default=1,
                   help="nodes (default 1); with --min-nodes the most the job asks for")
    r.add_argument("--min-nodes", type=int, default=None,
                   help="fewest nodes the job accepts (sbatch --nodes=MIN-MAX): each start takes what it is given, "
                        "DP from SLURM_NNODES, TP and PP from the recipe, the global batch kept; a requeued job "
                        "resumes its checkpoint at that layout")
    r.add_argument("--gpus-per-node", type=int, default=None)
    r.add_argument("--cpu", action="store_true", help="CPU nodes: no GPU request, --procs-per-node processes per node")
    r.add_argument("--procs-per-node", type=int, default=None, help="with --cpu (default 1)")
    r.add_argument("--cpus-per-task", type=int, default=8, help="CPUs for each node's task (default 8)")
    r.add_argument("--mem", help="memory per node (= per task), e.g. 200G")
    r.add_argument("--time", default="04:00:00", help="time limit (default 04:00:00)")
    r.add_argument("--partition")
    r.add_argument("--account")
    r.add_argument("--qos")
    r.add_argument("--sbatch", action="append", default=[], metavar="--OPTION[=VALUE]",
                   help="extra #SBATCH directive, raw (repeatable)")
    lch = p.add_argument_group("launch")
    lch.add_argument("--python", default=sys.executable, help="python on the nodes (default: this one)")
    lch.add_argument("--script", default=None, help="training script (default: this checkout's recipes/finetune.py)")
    lch.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="exported to every rank (repeatable)")
    lch.add_argument("--container-image", help="pyxis/enroot image for srun --container-image")
    lch.add_argument("--container-mounts")
    lch.add_argument("--rendezvous-timeout", type=int, default=600)
    pre = p.add_argument_group("preemption")
    pre.add_argument("--signal-lead", type=int, default=600, help="USR1 this many seconds before the time limit")
    pre.add_argument("--shutdown-timeout", type=int, default=480,
                     help="seconds torchrun gives the ranks to checkpoint and exit (must be < --signal-lead)")
    pre.add_argument("--max-restarts", type=int, default=3, help="self-requeues after USR1 (default 3)")
    wb = p.add_argument_group("W&B")
    wb.add_argument("--wandb-project", help="log to W&B (one run for the whole job, across requeues)")
    wb.add_argument("--wandb-mode", choices=("online", "offline", "disabled"))
    wb.add_argument("--wandb-run-id", help="default slurm-$SLURM_JOB_ID (or $TOOLKIT_WANDB_RUN_ID at submission)")
    return p


def job_from_args(args):
    from toolkit.errors import SlurmError
    from toolkit.slurm.render import DEFAULT_SCRIPT, Launch, Preemption, Resources, SlurmJob, WandbSettings

    if args.cpu == (args.gpus_per_node is not None):
        raise SlurmError("give exactly one of --gpus-per-node N and --cpu")
    if args.procs_per_node is not None and not args.cpu:
        raise SlurmError("--procs-per-node is for --cpu; GPU nodes run one process per GPU")
    env = []
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise SlurmError(f"--env {item!r} is not NAME=VALUE")
        env.append((name, value))
    resources = Resources(nodes=args.nodes, gpus_per_node=args.gpus_per_node or 0, procs_per_node=args.procs_per_node,
                          cpus_per_task=args.cpus_per_task, mem=args.mem, time=args.time, partition=args.partition,
                          account=args.account, qos=args.qos, min_nodes=args.min_nodes)
    launch = Launch(python=args.python, script=args.script or DEFAULT_SCRIPT, container_image=args.container_image,
                    container_mounts=args.container_mounts, rendezvous_timeout=args.rendezvous_timeout)
    return SlurmJob(config=args.config, overrides=tuple(args.overrides), job_name=args.job_name, output=args.output,
                    resources=resources, launch=launch,
                    preemption=Preemption(args.signal_lead, args.shutdown_timeout, args.max_restarts),
                    wandb=WandbSettings(args.wandb_project, args.wandb_mode, args.wandb_run_id),
                    env=tuple(env), extra_sbatch=tuple(args.sbatch), model=args.model, workdir=args.workdir)


def _parse(prog: str, argv: list[str], dry_run: bool = False):
    p = job_parser(prog)
    if dry_run:
        p.add_argument("--dry-run", action="store_true", help="write the script and show the sbatch command only")
    args = p.parse_intermixed_args(argv)
    return args, job_from_args(args)


def _out(args, job) -> str:
    return args.out or f"slurm/{job.job_name}.sbatch"


def _render(args) -> int:
    from toolkit.slurm.render import write

    parsed, job = _parse("toolkit slurm render", args.argv)
    print(f"wrote {write(job, _out(parsed, job))}")
    return 0


def _submit(args) -> int:
    from toolkit.slurm.submit import submit

    parsed, job = _parse("toolkit slurm submit", args.argv, dry_run=True)
    for line in submit(job, _out(parsed, job), dry_run=parsed.dry_run).lines():
        print(line)
    return 0


def _status(args) -> int:
    from toolkit.slurm.status import status

    print(status(args.job_id, args.run_dir).line())
    return 0
