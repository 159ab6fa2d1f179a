"""Render an sbatch script that runs recipes/finetune.py on N nodes, survives preemption and
requeues itself.

Launch: one `srun` task per node runs `torchrun` (static rendezvous at the first host of
`scontrol show hostnames`, `--node-rank $SLURM_NODEID`). We chose this over DeepSpeed's launcher
because srun starts exactly one agent per allocated node without ssh/pdsh or a hostfile, Slurm
tracks and kills every process it starts, and signals travel srun -> torchrun -> ranks. The static
rendezvous puts node 0's ranks first, so ranks are laid out exactly as on one machine.

Signals: `--signal=B:USR1@LEAD` reaches only the batch shell. Its trap forwards USR1 to srun,
which passes it to the torchrun agents; `--signals-to-handle` makes torchrun forward USR1 to the
ranks instead of dying, and `--shutdown-timeout` is the budget for the step plus checkpoint. The
trainer agrees on the flag with a collective, saves, and exits; the script then runs
`scontrol requeue` unless `max_restarts` restarts have happened.

Paths: every relative path is resolved at render time against the job's working directory
(default: where `render` runs), and the script `cd`s there before launching, so the job does not
depend on the directory sbatch runs from and the recipe's own relative paths (model.checkpoint,
data files, run_dir) mean what they meant when the recipe was checked.

Quoting: #SBATCH lines are parsed by sbatch, not bash, so quoting cannot protect them. Every field
that lands there is checked against what it may hold (a time, a partition name, a number); every
other user value is passed through shlex.quote into a variable or an array and only ever expanded
in double quotes. No field may hold a newline or a control character.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from toolkit.errors import SlurmError

DEFAULT_SCRIPT = str(Path(__file__).resolve().parents[2] / "recipes" / "finetune.py")
SLURM_SIGNAL_MAX_S = 65535  # sbatch --signal accepts at most 0xffff seconds
MASTER_PORT_BASE, MASTER_PORT_SPAN = 20000, 20000  # rendezvous port: 20000 + f(job id) % 20000

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # partition, account and QoS names
_PARTITIONS = re.compile(r"[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*")
_MEMORY = re.compile(r"[0-9]{1,9}[KMGT]?")
_OUTPUT = re.compile(r"[A-Za-z0-9_./%+-]{1,255}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_WANDB_PROJECT = re.compile(r"[A-Za-z0-9_.-]{1,128}")
# One `--option` or `--option=value`, no whitespace or quotes: sbatch splits #SBATCH lines itself.
_EXTRA_DIRECTIVE = re.compile(r"--[a-z][a-z0-9-]*(=[^\s'\"\\#]+)?")
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
# Anything below U+0020, DEL, C1 controls and the Unicode line/paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

# Options this script sets itself; an extra directive must not silently override them.
MANAGED_SBATCH = {"job-name", "nodes", "ntasks", "ntasks-per-node", "gpus-per-node", "gpus", "gres",
                  "cpus-per-task", "mem", "time", "partition", "account", "qos", "output", "error",
                  "open-mode", "requeue", "no-requeue", "signal", "export", "wrap"}
# Variables the launch chain sets per rank or per job; a user value would break the rendezvous.
# The script's own variables are reserved too, so a user value can't replace one of them.
SCRIPT_VARS = ("WORKDIR", "PYTHON", "RECIPE", "CONFIG", "OVERRIDES", "NPROC_PER_NODE", "MAX_RESTARTS", "SHUTDOWN_TIMEOUT",
               "RDZV_TIMEOUT", "RESTART", "PREEMPTED", "STEP_PID", "RC", "WANDB_RUN_ID_VALUE")
MANAGED_ENV = re.compile(r"(SLURM_|SBATCH_|SRUN_|PET_|TORCHELASTIC_|BASH_FUNC_).*|MASTER_ADDR|MASTER_PORT|RANK|"
                         r"LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|NODE_RANK|PATH|IFS|BASH_ENV|ENV|"
                         r"SHELLOPTS|BASHOPTS|PS4|LD_PRELOAD|LD_LIBRARY_PATH|" + "|".join(SCRIPT_VARS))
# Overrides the script sets itself.
MANAGED_OVERRIDES = {"resume", "wandb.enabled", "wandb.project", "wandb.run_id", "wandb.mode"}

# Defaults for the ranks' environment; each is overridable by exporting it before sbatch or with --env.
GPU_ENV_DEFAULTS = {
    "NCCL_DEBUG": "WARN",
    # A failed or timed-out NCCL collective tears the process down instead of hanging the job.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # megatron-core's TP communication overlap requires one hardware queue per device.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
}
# torch.distributed collective timeout (toolkit/runtime/distributed.py): a rank whose peer died
# gives up after this many minutes instead of waiting forever.
DIST_TIMEOUT_MIN = "10"


@dataclass(frozen=True)
class Resources:
    nodes: int = 1  # with min_nodes: the most nodes the job asks for (sbatch --nodes=MIN-MAX)
    gpus_per_node: int = 0  # 0 renders for CPU nodes: no GPU request, procs_per_node processes
    procs_per_node: int | None = None  # CPU only (default 1); on GPUs it is gpus_per_node
    cpus_per_task: int = 8  # one task per node, so this is the CPUs of the node's torchrun
    mem: str | None = None  # per node (= per task), e.g. 200G
    time: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    # Fewest nodes the job accepts (sbatch --nodes=MIN-MAX); the trainer takes DP from the world size
    # it starts with (SLURM_NNODES x processes per node), TP and PP from the recipe. None: exactly `nodes`.
    min_nodes: int | None = None

    @property
    def node_counts(self) -> range:
        return range(self.min_nodes or self.nodes, self.nodes + 1)

    @property
    def cpu(self) -> bool:
        return self.gpus_per_node == 0

    @property
    def nproc_per_node(self) -> int:
        return (self.procs_per_node or 1) if self.cpu else self.gpus_per_node


@dataclass(frozen=True)
class Launch:
    python: str = sys.executable  # the interpreter that has the toolkit installed, on the nodes
    script: str = DEFAULT_SCRIPT
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    container_mounts: str | None = None
    rendezvous_timeout: int = 600  # seconds torchrun waits for every node to join


@dataclass(frozen=True)
class Preemption:
    signal_lead: int = 600  # USR1 this many seconds before the time limit
    shutdown_timeout: int = 480  # torchrun waits this long for the ranks to checkpoint and exit
    max_restarts: int = 3  # self-requeues after USR1; then the job ends and can be resubmitted


@dataclass(frozen=True)
class WandbSettings:
    project: str | None = None  # enables W&B logging (rank 0, by our trainer)
    mode: str | None = None  # online | offline | disabled; WANDB_MODE from the environment wins
    run_id: str | None = None  # default: slurm-$SLURM_JOB_ID, the same across requeues


@dataclass(frozen=True)
class SlurmJob:
    config: str  # the recipe YAML
    overrides: tuple[str, ...] = ()
    job_name: str = "finetune"
    output: str = "%x-%j.out"  # #SBATCH --output; appended to across requeues
    resources: Resources = field(default_factory=Resources)
    launch: Launch = field(default_factory=Launch)
    preemption: Preemption = field(default_factory=Preemption)
    wandb: WandbSettings = field(default_factory=WandbSettings)
    env: tuple[tuple[str, str], ...] = ()  # exported in the script, reaches every rank
    extra_sbatch: tuple[str, ...] = ()  # raw `--option=value` directives, checked one by one
    # The model the layout is checked against (HF directory, config.json or converted checkpoint);
    # default: the recipe's model.checkpoint where it exists at render time.
    model: str | None = None
    workdir: str | None = None  # where the job runs; relative paths resolve here (default: the current directory)


# ---------------------------------------------------------------------------------- validation


def _text(name: str, value: str) -> str:
    if not isinstance(value, str):
        raise SlurmError(f"{name} must be text, got {type(value).__name__}")
    if _CONTROL.search(value):
        raise SlurmError(f"{name} {value!r} contains a newline or control character")
    return value


def _path(name: str, value: str) -> None:
    """Any text a path may hold, except an empty one or one that a command would read as an option."""
    _text(name, value)
    if not value or value.startswith("-"):
        raise SlurmError(f"{name} {value!r} must be non-empty and not start with '-'")


def _match(name: str, value: str | None, pattern: re.Pattern, what: str) -> None:
    if value is None:
        return
    _text(name, value)
    if not pattern.fullmatch(value):
        raise SlurmError(f"{name} {value!r} is not {what}")


def _int(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SlurmError(f"{name} must be a whole number from {low} to {high}, got {value!r}")


def parse_time(value: str) -> int:
    """Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S."""
    _text("time", value)
    m = re.fullmatch(r"(?:(\d{1,3})-)?(\d{1,5})(?::(\d{1,2}))?(?::(\d{1,2}))?", value)
    if not m or value in ("0",):
        raise SlurmError(f"time {value!r} is not a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        seconds = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        seconds = int(a) * 3600 + int(b) * 60 + int(c)
    else:  # M or M:S
        seconds = int(a) * 60 + int(b or 0)
    if seconds <= 0:
        raise SlurmError(f"time {value!r} is zero")
    return seconds


def _check_resources(r: Resources) -> None:
    _int("nodes", r.nodes, 1, 100_000)
    if r.min_nodes is not None:
        _int("min_nodes", r.min_nodes, 1, r.nodes)
    _int("gpus_per_node", r.gpus_per_node, 0, 64)
    if r.procs_per_node is not None:
        _int("procs_per_node", r.procs_per_node, 1, 1024)
        if not r.cpu and r.procs_per_node != r.gpus_per_node:
            raise SlurmError("procs_per_node is for CPU nodes; on GPU nodes it is one process per GPU")
    _int("cpus_per_task", r.cpus_per_task, 1, 4096)
    _match("mem", r.mem, _MEMORY, "a memory size such as 200G or 512000M")
    parse_time(r.time)
    _match("partition", r.partition, _PARTITIONS, "a partition name (or a comma-separated list)")
    _match("account", r.account, _SLURM_WORD, "an account name (letters, digits, _ . -)")
    _match("qos", r.qos, _SLURM_WORD, "a QoS name (letters, digits, _ . -)")


def _check_env(env) -> None:
    for name, value in env:
        _match("env name", name, _ENV_NAME, "an environment variable name")
        if MANAGED_ENV.fullmatch(name):
            raise SlurmError(f"env {name} is set by Slurm, torchrun or this script; it cannot be given")
        if _SECRET_NAME.search(name):
            raise SlurmError(f"env {name} looks like a secret: never write it into a script; export it in the "
                             "submitting shell instead (the script passes the environment on with --export=ALL)")
        _text(f"env {name}", value)


def _check_overrides(overrides) -> None:
    for item in overrides:
        _text("override", item)
        key, sep, _ = item.partition("=")
        if not sep or not _OVERRIDE_KEY.fullmatch(key):
            raise SlurmError(f"override {item!r} is not of the form key.sub=value")
        if key in MANAGED_OVERRIDES:
            raise SlurmError(f"override {key} is set by the script (resume=auto on every start; W&B by --wandb-*)")


def _check_extra(extra) -> None:
    for line in extra:
        _text("extra #SBATCH directive", line)
        if not _EXTRA_DIRECTIVE.fullmatch(line):
            raise SlurmError(f"extra #SBATCH directive {line!r} must be a single --option or --option=value "
                             "with no spaces or quotes")
        option = line[2:].partition("=")[0]
        if option in MANAGED_SBATCH:
            raise SlurmError(f"extra #SBATCH directive --{option} would override one the script sets; use its own flag")


def _recipe(config: str, overrides):
    """The recipe as the trainer will read it (unknown keys and bad values are refused here)."""
    import yaml

    from toolkit.errors import ToolkitError
    from toolkit.train.config import load_config

    try:
        cfg = load_config(config, list(overrides))
    except ToolkitError as e:
        raise SlurmError(f"recipe {config}: {e}") from None
    except yaml.YAMLError as e:  # the trainer reads each override value as YAML
        raise SlurmError(f"recipe {config} or an override is not valid YAML: {str(e).splitlines()[0]}") from None
    return cfg


def _under(workdir: str, path: str) -> str:
    """`path` made absolute against `workdir`, otherwise verbatim (no normalisation)."""
    return path if os.path.isabs(path) else os.path.join(workdir, path)


def anchored(job: SlurmJob) -> SlurmJob:
    """The job with every path absolute: config, script, python (when it is a path, not a command
    name looked up on PATH), the model and the log; the working directory recorded."""
    workdir = os.path.abspath(job.workdir or os.getcwd())
    python = _under(workdir, job.launch.python) if "/" in job.launch.python else job.launch.python
    launch = replace(job.launch, python=python, script=_under(workdir, job.launch.script))
    output = job.output if job.output.startswith("/") else workdir.replace("%", "%%") + "/" + job.output
    model = _under(workdir, job.model) if job.model is not None else None
    return replace(job, config=_under(workdir, job.config), launch=launch, output=output, model=model, workdir=workdir)


def _check_model(job: SlurmJob, cfg) -> None:
    """The model x layout check `convert` makes (Layout.check), against the model the job will load."""
    from toolkit import modelspec
    from toolkit.errors import ToolkitError
    from toolkit.layouts import RECIPE_NAMES, Layout

    given = job.model is not None
    path = job.model if given else _under(job.workdir, cfg.model.checkpoint)
    if not given and not os.path.exists(path):
        return  # the checkpoint is only on the cluster: --model checks against a local copy
    try:
        Layout(cfg.parallel.tp, cfg.parallel.pp).check(modelspec.read(path), RECIPE_NAMES)
    except ToolkitError as e:
        source = "--model" if given else "model.checkpoint"
        raise SlurmError(f"{source} {path} at TP {cfg.parallel.tp} x PP {cfg.parallel.pp}: {e}") from None


def _fits(cfg, world: int) -> str | None:
    """Why the recipe cannot run on `world` processes (one line), or None."""
    from toolkit.train.build import data_parallel_size

    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world % (tp * pp):
        return f"{world} is not divisible by the recipe's TP x PP = {tp} x {pp}"
    try:
        data_parallel_size(cfg, world)
    except Exception as e:  # noqa: BLE001 - the trainer's own layout error, as one line
        return str(e)
    return None


# The tiny CPU example's recipe: a GPU job that kept its data, run directory or learning rate
# almost certainly copied it by mistake (3e-3 diverges a real model; the data is digit reversal).
EXAMPLE_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
EXAMPLE_KEYS = ("data.train_file", "data.valid_file", "run_dir", "optim.lr")


def _value(cfg, key: str):
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _refuse_example_values(job: SlurmJob, cfg) -> None:
    """One line naming the tiny CPU example's values a GPU job still has, unless overridden."""
    from toolkit.train.config import load_config

    if not EXAMPLE_RECIPE.is_file():
        return
    example = load_config(str(EXAMPLE_RECIPE))
    kept = [f"{key}={_value(cfg, key)}" for key in EXAMPLE_KEYS if _value(cfg, key) == _value(example, key)]
    if kept:
        raise SlurmError(f"recipe {job.config} keeps the tiny CPU example's {', '.join(kept)}: give your own "
                         f"(e.g. {kept[0].split('=')[0]}=...) as an override, or start from a GPU recipe "
                         "(recipes/*.yaml) or `toolkit plan -o DIR`")


def _check_node_counts(job: SlurmJob, cfg) -> None:
    """Every node count the allocation may have must run the recipe (TP x PP fixed, DP = the rest,
    the global batch kept): otherwise one line naming the counts that can."""
    r = job.resources
    unit = "GPUs" if not r.cpu else "processes"
    bad = {n: why for n in r.node_counts if (why := _fits(cfg, n * r.nproc_per_node))}
    if not bad:
        return
    n, why = next(iter(bad.items()))
    if r.min_nodes is None:
        raise SlurmError(f"recipe {job.config} on {n} nodes x {r.nproc_per_node} {unit}: {why}")
    good = [m for m in range(1, r.nodes + 1) if not _fits(cfg, m * r.nproc_per_node)]
    raise SlurmError(f"recipe {job.config} on {n} nodes x {r.nproc_per_node} {unit} (within --min-nodes "
                     f"{r.min_nodes} --max-nodes {r.nodes}): {why}; node counts up to {r.nodes} that fit: {good or 'none'}")


def validate(job: SlurmJob) -> SlurmJob:
    """Every check, before anything is written: SlurmError names the first bad field. Returns the
    job anchored (every path absolute)."""
    _path("config", job.config)
    _check_overrides(job.overrides)
    _match("job_name", job.job_name, _NAME, "a job name (letters, digits, _ . -; at most 64)")
    _match("output", job.output, _OUTPUT, "an output path without spaces or quotes (Slurm patterns like %j allowed)")
    if job.output.startswith("-"):
        raise SlurmError(f"output {job.output!r} must not start with '-'")
    r, launch, p, wb = job.resources, job.launch, job.preemption, job.wandb
    _check_resources(r)
    for name in ("python", "script", "container_image", "container_mounts"):
        if getattr(launch, name) is not None:
            _path(name, getattr(launch, name))
    if launch.container_mounts and not launch.container_image:
        raise SlurmError("container_mounts needs container_image")
    _int("rendezvous_timeout", launch.rendezvous_timeout, 1, 86_400)
    limit = parse_time(r.time)
    _int("signal_lead", p.signal_lead, 1, min(SLURM_SIGNAL_MAX_S, limit - 1) if limit > 1 else 1)
    _int("shutdown_timeout", p.shutdown_timeout, 1, p.signal_lead)
    _int("max_restarts", p.max_restarts, 0, 1000)
    _match("wandb project", wb.project, _WANDB_PROJECT, "a W&B project name")
    _match("wandb run id", wb.run_id, _WANDB_ID, "a W&B run id (letters, digits, _ -)")
    if wb.mode not in (None, "online", "offline", "disabled"):
        raise SlurmError(f"wandb mode {wb.mode!r} is not online, offline or disabled")
    if (wb.mode or wb.run_id) and not wb.project:
        raise SlurmError("wandb mode and run id need a wandb project")
    _check_env(job.env)
    _check_extra(job.extra_sbatch)
    for name in ("model", "workdir"):
        if getattr(job, name) is not None:
            _path(name, getattr(job, name))
    job = anchored(job)
    if not _OUTPUT.fullmatch(job.output):
        raise SlurmError(f"the log path resolves to {job.output!r}, which an #SBATCH line cannot hold: "
                         "give an absolute --output without spaces or quotes")

    from toolkit.train.build import data_parallel_size

    cfg = _recipe(job.config, job.overrides)
    if not r.cpu:
        _refuse_example_values(job, cfg)
    _check_node_counts(job, cfg)
    _check_model(job, cfg)
    return job


# ---------------------------------------------------------------------------------- rendering


def command_line(job: SlurmJob) -> str:
    """The `toolkit slurm render` command that reproduces this script (kept in its header)."""
    r, launch, p, wb = job.resources, job.launch, job.preemption, job.wandb
    args = ["toolkit", "slurm", "render", job.config, *job.overrides]  # an override never starts with "-"
    opts = [("--job-name", job.job_name), ("--nodes", r.nodes), ("--min-nodes", r.min_nodes)]
    opts += [("--procs-per-node", r.nproc_per_node)] if r.cpu else [("--gpus-per-node", r.gpus_per_node)]
    opts += [("--cpus-per-task", r.cpus_per_task), ("--mem", r.mem), ("--time", r.time),
             ("--partition", r.partition), ("--account", r.account), ("--qos", r.qos), ("--output", job.output),
             ("--python", launch.python), ("--script", launch.script), ("--container-image", launch.container_image),
             ("--container-mounts", launch.container_mounts), ("--rendezvous-timeout", launch.rendezvous_timeout),
             ("--signal-lead", p.signal_lead), ("--shutdown-timeout", p.shutdown_timeout),
             ("--max-restarts", p.max_restarts), ("--wandb-project", wb.project), ("--wandb-mode", wb.mode),
             ("--wandb-run-id", wb.run_id), ("--model", job.model), ("--workdir", job.workdir)]
    opts += [("--env", f"{k}={v}") for k, v in job.env] + [("--sbatch", line) for line in job.extra_sbatch]
    args += [f"{flag}={value}" for flag, value in opts if value is not None]
    if r.cpu:
        args.append("--cpu")
    return " ".join(shlex.quote(str(a)) for a in args)


def _sbatch_lines(job: SlurmJob) -> list[str]:
    r, p = job.resources, job.preemption
    if r.min_nodes in (None, r.nodes):
        lines = [f"--job-name={job.job_name}", f"--nodes={r.nodes}", "--ntasks-per-node=1"]
    else:  # with --ntasks-per-node, Slurm (22.05) sizes the job for MIN nodes and never grants more
        lines = [f"--job-name={job.job_name}", f"--nodes={r.min_nodes}-{r.nodes}"]
    if not r.cpu:
        lines.append(f"--gpus-per-node={r.gpus_per_node}")
    lines.append(f"--cpus-per-task={r.cpus_per_task}")
    if r.mem:
        lines.append(f"--mem={r.mem}")
    lines.append(f"--time={r.time}")
    lines += [f"--{name}={value}" for name, value in
              (("partition", r.partition), ("account", r.account), ("qos", r.qos)) if value]
    lines += [f"--output={job.output}", "--open-mode=append", "--requeue",
              f"--signal=B:USR1@{p.signal_lead}", "--export=ALL"]
    return [f"#SBATCH {line}" for line in lines]


def _env_lines(job: SlurmJob) -> list[str]:
    r = job.resources
    threads = max(1, r.cpus_per_task // r.nproc_per_node)
    defaults = {"OMP_NUM_THREADS": str(threads), "TOOLKIT_DIST_TIMEOUT_MIN": DIST_TIMEOUT_MIN}
    if not r.cpu:
        defaults.update(GPU_ENV_DEFAULTS)
    if job.wandb.mode:
        defaults["WANDB_MODE"] = job.wandb.mode
    lines = [f'export {name}="${{{name}:-{value}}}"' for name, value in defaults.items()]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in job.env]
    return lines


def _srun_prefix(job: SlurmJob) -> str:
    parts = ["srun --kill-on-bad-exit=1 --export=ALL --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1"]
    if job.launch.container_image:
        parts.append(f"--container-image={shlex.quote(job.launch.container_image)}")
        if job.launch.container_mounts:
            parts.append(f"--container-mounts={shlex.quote(job.launch.container_mounts)}")
    return " ".join(parts)


def _nodes_text(r: Resources) -> str:
    return f"{r.min_nodes} to {r.nodes}" if r.min_nodes not in (None, r.nodes) else str(r.nodes)


def render(job: SlurmJob) -> str:
    """The sbatch script for `job`; raises SlurmError before producing anything if a field is bad."""
    job = validate(job)
    q = shlex.quote
    r, launch, p, wb = job.resources, job.launch, job.preemption, job.wandb
    overrides = " ".join(q(o) for o in job.overrides)
    wandb_lines = []
    if wb.project:
        run_id = q(wb.run_id) if wb.run_id else '"${TOOLKIT_WANDB_RUN_ID:-slurm-$SLURM_JOB_ID}"'
        wandb_lines = [
            "# One W&B run for the whole job: the same id on every restart, resumed by our trainer on rank 0.",
            f"WANDB_RUN_ID_VALUE={run_id}",
            f'OVERRIDES+=(wandb.enabled=true wandb.project={q(wb.project)} "wandb.run_id=$WANDB_RUN_ID_VALUE")',
        ]
    head = [
        "#!/bin/bash",
        f"# Fine-tuning on {_nodes_text(r)} {'CPU' if r.cpu else 'GPU'} node(s), rendered by toolkit. Re-render instead of editing:",
        f"#   {command_line(job)}",
        *_sbatch_lines(job),
        *(f"#SBATCH {line}  # extra (raw)" for line in job.extra_sbatch),
    ]
    body = f"""
set -uo pipefail

# Values given to `toolkit slurm render`, shell-quoted; they are only ever expanded in double quotes.
# Paths are absolute, and the job runs in WORKDIR wherever sbatch was run from.
WORKDIR={q(job.workdir)}
PYTHON={q(launch.python)}
RECIPE={q(launch.script)}
CONFIG={q(job.config)}
OVERRIDES=({overrides})
NPROC_PER_NODE={r.nproc_per_node}
MAX_RESTARTS={p.max_restarts}
SHUTDOWN_TIMEOUT={p.shutdown_timeout}
RDZV_TIMEOUT={launch.rendezvous_timeout}

# Environment of every rank (srun and torchrun pass it on). Defaults first: export one before
# sbatch to override it. Secrets (WANDB_API_KEY, HF_TOKEN) are never written here; they are
# inherited from the submitting shell.
{chr(10).join(_env_lines(job))}

cd -- "$WORKDIR" || {{ echo "toolkit: cannot enter $WORKDIR" >&2; exit 1; }}
RESTART=${{SLURM_RESTART_COUNT:-0}}
# Rendezvous at the first allocated host; its torchrun holds ranks 0..NPROC_PER_NODE-1.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$(( {MASTER_PORT_BASE} + (SLURM_JOB_ID + 1000 * RESTART) % {MASTER_PORT_SPAN} ))
OVERRIDES+=(resume=auto)
{"".join(line + chr(10) for line in wandb_lines)}echo "toolkit: job $SLURM_JOB_ID start $RESTART on $SLURM_JOB_NODELIST ($SLURM_NNODES x $NPROC_PER_NODE), rendezvous $MASTER_ADDR:$MASTER_PORT"

# USR1 (time limit ahead, or `scancel --signal=USR1 --batch`) reaches only this shell: remember it
# and forward it to srun, which passes it to the torchrun agents, which pass it to the ranks.
# TERM (preemption, scancel) is forwarded the same way; Slurm requeues preempted jobs itself.
PREEMPTED=
STEP_PID=
forward() {{ PREEMPTED=$1; [ -n "$STEP_PID" ] && kill -s "$1" "$STEP_PID" 2>/dev/null; return 0; }}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# One task per node. The node rank is expanded on each node; user values travel as arguments.
{_srun_prefix(job)} \\
  bash -c 'exec "$0" -m torch.distributed.run --node-rank="$SLURM_NODEID" "$@"' "$PYTHON" \\
  --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC_PER_NODE" \\
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --rdzv-conf="timeout=$RDZV_TIMEOUT" \\
  --max-restarts=0 --monitor-interval=1 \\
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout="$SHUTDOWN_TIMEOUT" \\
  "$RECIPE" --config "$CONFIG" "${{OVERRIDES[@]}}" &
STEP_PID=$!
# A trapped signal interrupts `wait`; keep waiting until the step has really ended.
while kill -0 "$STEP_PID" 2>/dev/null; do wait "$STEP_PID"; done
wait "$STEP_PID"; RC=$?

if [ "$RC" -eq 0 ]; then
  echo "toolkit: training finished"
  exit 0
fi
if [ "$PREEMPTED" = USR1 ]; then
  if [ "$RESTART" -lt "$MAX_RESTARTS" ]; then
    echo "toolkit: stopped on SIGUSR1 after a checkpoint; requeueing (restart $((RESTART + 1)) of $MAX_RESTARTS)"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "toolkit: scontrol requeue failed" >&2
  else
    echo "toolkit: stopped on SIGUSR1 and the restart cap ($MAX_RESTARTS) is reached; resubmit to resume" >&2
  fi
fi
echo "toolkit: step exited with $RC" >&2
exit "$RC"
"""
    return "\n".join(head) + "\n" + body


def write(job: SlurmJob, path: str | Path) -> Path:
    """Render (validating everything first), then write the script, executable."""
    from toolkit.atomic import write_file

    text = render(job)
    return write_file(path, text, job.config, job.model, mode=0o755)
