"""`toolkit slurm render`: validation, quoting, the CPU/GPU renderings and the checked-in examples."""

from __future__ import annotations

import dataclasses
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.slurm.conftest import REPO, toolkit
from toolkit.errors import SlurmError
from toolkit.slurm import Launch, Preemption, Resources, SlurmJob, WandbSettings, render
from toolkit.slurm.render import parse_time, write

EXAMPLES = sorted((REPO / "slurm").glob("*.sbatch"))
# Rendered scripts hold absolute paths; the checked-in examples show this checkout as:
CHECKOUT = "/path/to/megatron-ds-toolkit"


def hostile_strings(canary: Path) -> list[str]:
    c = shlex.quote(str(canary))
    return [f"$(touch {c})", f"`touch {c}`", f"'; touch {c}; '", f'"; touch {c}; "', f"x\ntouch {c}",
            f"a b; touch {c} #", f"${{IFS}}touch${{IFS}}{c}", f"\\\"$(touch {c})\\\"", f"x\rtouch {c}",
            f"x\u2028touch {c}", "*", "~root", "$((1+1))"]


@pytest.fixture
def recipe_file(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"checkpoint": "ckpt"}, "data": {"train_file": "train.jsonl"},
                                    "parallel": {"tp": 2, "pp": 2}, "micro_batch": 2, "global_batch": 16}))
    return path


def cpu_job(config: Path, **changes) -> SlurmJob:
    job = SlurmJob(config=str(config), resources=Resources(nodes=2, procs_per_node=2, cpus_per_task=2, time="30"),
                   launch=Launch(python=sys.executable, script="recipes/finetune.py"),
                   preemption=Preemption(signal_lead=120, shutdown_timeout=90, max_restarts=2))
    return dataclasses.replace(job, **changes)


def replace_in(job: SlurmJob, path: str, value) -> SlurmJob:
    """SlurmJob with one (possibly nested, 'section.field') field replaced."""
    section, _, name = path.partition(".")
    if not name:
        return dataclasses.replace(job, **{section: value})
    return dataclasses.replace(job, **{section: dataclasses.replace(getattr(job, section), **{name: value})})


# ------------------------------------------------------------------------------------ examples


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_checked_in_example_equals_what_render_produces(example, tmp_path):
    """Each example's third line is the command that made it; re-running it must give the same bytes."""
    text = example.read_text().replace(CHECKOUT, str(REPO))
    command = text.splitlines()[2].removeprefix("#   ")
    argv = shlex.split(command)
    assert argv[:3] == ["toolkit", "slurm", "render"]
    out = tmp_path / example.name
    subprocess.run([sys.executable, "-m", "toolkit", "slurm", "render", *argv[3:], "-o", str(out)], cwd=REPO,
                   check=True, capture_output=True, text=True)
    assert out.read_text() == text, f"{example} drifted from `toolkit slurm render`: re-render it"
    subprocess.run(["bash", "-n", str(example)], check=True)


def test_examples_cover_a_gpu_and_a_cpu_rendering():
    texts = {p.name: p.read_text() for p in EXAMPLES}
    assert "#SBATCH --gpus-per-node=8" in texts["finetune-gpu.sbatch"]
    assert "NPROC_PER_NODE=8" in texts["finetune-gpu.sbatch"]
    assert 'NCCL_DEBUG="${NCCL_DEBUG:-WARN}"' in texts["finetune-gpu.sbatch"]
    cpu = texts["finetune-cpu.sbatch"]
    assert "gpus" not in cpu and "gres" not in cpu and "NCCL" not in cpu
    assert "NPROC_PER_NODE=2" in cpu


def test_gpu_launch_line_is_one_torchrun_per_node_with_static_rendezvous_and_usr1_forwarding(recipe_file):
    text = render(cpu_job(recipe_file, resources=Resources(nodes=4, gpus_per_node=8, cpus_per_task=96)))
    assert "srun --kill-on-bad-exit=1 --export=ALL --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1" in text
    assert "bash -c 'exec \"$0\" -m torch.distributed.run --node-rank=\"$SLURM_NODEID\" \"$@\"' \"$PYTHON\"" in text
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"' in text
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-12}"' in text  # 96 CPUs / 8 ranks


# ------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("nodes,gpus,message", [(1, 3, "not divisible by the recipe's TP x PP = 2 x 2"),
                                                (3, 2, "not divisible by the recipe's TP x PP = 2 x 2"),
                                                (1, 12, "global_batch 16 is not divisible")])
def test_layout_that_does_not_divide_is_refused_before_anything_is_written(recipe_file, tmp_path, nodes, gpus, message):
    out = tmp_path / "out" / "job.sbatch"
    with pytest.raises(SlurmError, match=message):
        write(cpu_job(recipe_file, resources=Resources(nodes=nodes, gpus_per_node=gpus)), out)
    assert not out.parent.exists()


def test_recipe_errors_surface_before_rendering(recipe_file):
    with pytest.raises(SlurmError, match="unknown config key"):
        render(cpu_job(recipe_file, overrides=("optim.lrr=1",)))
    with pytest.raises(SlurmError, match="does not exist"):
        render(cpu_job(recipe_file.with_name("missing.yaml")))
    for managed in ("resume=none", "wandb.run_id=x"):
        with pytest.raises(SlurmError, match="set by the script"):
            render(cpu_job(recipe_file, overrides=(managed,)))


SBATCH_FIELDS = ["job_name", "output", "resources.time", "resources.mem", "resources.partition", "resources.account",
                 "resources.qos", "wandb.project", "wandb.run_id", "wandb.mode"]
SHELL_FIELDS = ["config", "launch.python", "launch.script", "launch.container_image", "launch.container_mounts"]


@pytest.mark.parametrize("field", SBATCH_FIELDS)
def test_fields_on_sbatch_lines_refuse_every_hostile_string(recipe_file, tmp_path, field):
    job = cpu_job(recipe_file, wandb=WandbSettings(project="p"))
    for value in hostile_strings(tmp_path / "CANARY"):
        with pytest.raises(SlurmError):
            render(replace_in(job, field, value))


@pytest.mark.parametrize("field", SHELL_FIELDS + ["overrides", "env", "extra_sbatch"])
def test_newlines_and_control_characters_are_refused_in_every_field(recipe_file, field):
    job = cpu_job(recipe_file, launch=Launch(python="python3", container_image="img"))
    for bad in ("a\nb", "a\rb", "a\x00b", "a\x1bb", "a\u2028b", "a\x85b"):
        value = {"overrides": (f"data.train_file={bad}",), "env": (("PROBE", bad),),
                 "extra_sbatch": (f"--comment={bad}",)}.get(field, bad)
        with pytest.raises(SlurmError, match="newline or control character"):
            render(replace_in(job, field, value))


@pytest.mark.parametrize("field,value,message", [
    ("resources.nodes", 0, "nodes must be a whole number"),
    ("resources.nodes", "2", "nodes must be a whole number"),
    ("resources.cpus_per_task", True, "cpus_per_task must be a whole number"),
    ("resources.time", "1-2:3:4:5", "not a Slurm time limit"),
    ("resources.time", "0:00:00", "is zero"),
    ("resources.mem", "10 G", "not a memory size"),
    ("preemption.signal_lead", 1800, "signal_lead must be a whole number from 1 to 1799"),  # time limit 30 min
    ("preemption.shutdown_timeout", 121, "shutdown_timeout must be a whole number from 1 to 120"),
    ("preemption.max_restarts", -1, "max_restarts"),
    ("launch.python", "-c", "must be non-empty and not start with '-'"),
    ("config", "--help", "must be non-empty and not start with '-'"),
    ("output", "-o", "not start with '-'"),
    ("wandb.mode", "offline", "need a wandb project"),
])
def test_each_field_is_checked_against_what_it_may_hold(recipe_file, field, value, message):
    with pytest.raises(SlurmError, match=message):
        render(replace_in(cpu_job(recipe_file), field, value))


def test_time_limits_in_every_slurm_format():
    assert [parse_time(t) for t in ("30", "30:15", "2:00:00", "1-0", "1-2:30", "1-02:30:05")] == \
        [1800, 1815, 7200, 86400, 95400, 95405]


@pytest.mark.parametrize("line,message", [
    ("--constraint=a100 --nodes=9", "single --option"), ("--comment='x y'", "single --option"),
    ("-N 9", "single --option"), ("--nodes=9", "override one the script sets"),
    ("--signal=USR2@60", "override one the script sets"), ("--output=/tmp/x", "override one the script sets"),
    ("--wrap=id", "override one the script sets"), ("--comment=#SBATCH", "single --option"),
])
def test_extra_directives_must_be_one_unmanaged_directive_each(recipe_file, line, message):
    with pytest.raises(SlurmError, match=message):
        render(cpu_job(recipe_file, extra_sbatch=(line,)))
    text = render(cpu_job(recipe_file, extra_sbatch=("--constraint=a100&ib", "--exclusive")))
    assert "#SBATCH --constraint=a100&ib  # extra (raw)\n#SBATCH --exclusive  # extra (raw)" in text


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "my_api_key"])
def test_secrets_are_refused_and_never_written(recipe_file, name):
    with pytest.raises(SlurmError, match="looks like a secret"):
        render(cpu_job(recipe_file, env=((name, "s3cr3t-value"),)))


@pytest.mark.parametrize("name", ["MASTER_ADDR", "RANK", "SLURM_NODEID", "PATH", "LD_PRELOAD", "PYTHON", "OVERRIDES",
                                  "BASH_ENV", "PET_NODE_RANK"])
def test_env_cannot_replace_what_the_launch_chain_sets(recipe_file, name):
    with pytest.raises(SlurmError, match="cannot be given"):
        render(cpu_job(recipe_file, env=((name, "x"),)))


# ------------------------------------------------------------------------------------ injection


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run_with_stand_ins(script: Path, tmp_path: Path, cwd: Path) -> None:
    """Run the script with stand-ins for scontrol and srun (srun records its options in srun.bin,
    then runs the real `bash -c` line as node 0 would)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "scontrol", "#!/bin/bash\n[ \"$1 $2\" = 'show hostnames' ] && printf 'n1\\nn2\\n'\n")
    _executable(bin_dir / "srun", f"""#!/bin/bash
{{ printf '%s\\0' "$@"; }} > {shlex.quote(str(tmp_path / 'srun.bin'))}
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
""")
    run_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]",
               "SLURM_NNODES": "2", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(script)], env=run_env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hostile_strings_in_shell_fields_render_inert_and_running_the_script_executes_nothing(tmp_path):
    """Every field that is not refused is hostile at once: bash -n passes, and running the script with
    stand-ins for srun/scontrol (srun runs the real `bash -c` line with SLURM_NODEID set) passes each
    value through verbatim and never creates the canary."""
    canary = tmp_path / "CANARY"
    evil = hostile_strings(canary)
    printable = [s for s in evil if not any(c in s for c in "\n\r\u2028")]
    weird = tmp_path / "d $(touch CANARY) `x` 'q' \"d\""  # hostile directory that really exists
    weird.mkdir()
    recorder = _executable(weird / "py $(touch CANARY);'", f"""#!/bin/bash
{{ printf '%s\\0' "$@"; }} > {shlex.quote(str(tmp_path / 'argv.bin'))}
env -0 > {shlex.quote(str(tmp_path / 'env.bin'))}
""")
    config = weird / "recipe `touch CANARY` $(id).yaml"
    config.write_text(yaml.safe_dump({"model": {"checkpoint": printable[0]}, "data": {"train_file": printable[1]},
                                      "parallel": {"tp": 2, "pp": 2}, "micro_batch": 2, "global_batch": 16}))
    # The trainer reads override values as YAML: "x" first keeps each a plain string.
    overrides = tuple(f"model.checkpoint=x{s}" for s in printable) + ("data.train_file=--config",)
    env = tuple((f"PROBE_{i}", s) for i, s in enumerate(printable))
    job = cpu_job(config, overrides=overrides, env=env,
                  launch=Launch(python=str(recorder), script=printable[2], container_image=printable[3],
                                container_mounts=printable[4]))
    script = write(job, tmp_path / "job.sbatch")
    subprocess.run(["bash", "-n", str(script)], check=True)

    run_with_stand_ins(script, tmp_path, cwd=tmp_path)
    assert not canary.exists() and not (weird / "CANARY").exists() and not (tmp_path / "CANARY").exists()

    argv = (tmp_path / "argv.bin").read_bytes().decode().split("\0")[:-1]
    assert argv[:3] == ["-m", "torch.distributed.run", "--node-rank=0"]
    script_path = os.path.join(os.getcwd(), printable[2])  # made absolute, otherwise verbatim
    tail = argv[argv.index(script_path):]  # the training script, then its arguments
    assert tail == [script_path, "--config", str(config), *overrides, "resume=auto"]
    srun_args = (tmp_path / "srun.bin").read_bytes().decode().split("\0")
    assert f"--container-image={printable[3]}" in srun_args and f"--container-mounts={printable[4]}" in srun_args
    ranks_env = dict(item.split("=", 1) for item in (tmp_path / "env.bin").read_bytes().decode().split("\0") if "=" in item)
    assert all(ranks_env[name] == value for name, value in env)


def test_cli_errors_are_one_line_and_write_nothing(recipe_file, tmp_path):
    out = tmp_path / "job.sbatch"
    result = toolkit("slurm", "render", str(recipe_file), "--cpu", "--nodes", "2", "--procs-per-node", "2",
                     "--job-name", "a b", "-o", str(out), check=False)
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip().count("\n") == 0 and "job_name 'a b' is not a job name" in result.stderr
    result = toolkit("slurm", "render", str(recipe_file), "--nodes", "2", "-o", str(out), check=False)
    assert "give exactly one of --gpus-per-node N and --cpu" in result.stderr


def test_submit_dry_run_writes_the_script_and_calls_no_sbatch(recipe_file, tmp_path):
    out = tmp_path / "job.sbatch"
    result = toolkit("slurm", "submit", str(recipe_file), "optim.lr=1e-4", "--cpu", "--nodes", "2",
                     "--procs-per-node", "2", "--time", "30", "--signal-lead", "120", "--shutdown-timeout", "60",
                     "-o", str(out), "--dry-run", env={"PATH": "/nonexistent"})
    assert out.is_file() and f"sbatch --parsable {out}" in result.stdout
    assert f"output: {os.getcwd()}/finetune-%j.out" in result.stdout, "the log path as the script holds it"
    assert "OVERRIDES=(optim.lr=1e-4)" in out.read_text()
    assert os.access(out, os.X_OK)


# ------------------------------------------------------------------------------------ model x layout


@pytest.fixture(scope="module")
def four_head_checkpoint(tmp_path_factory) -> Path:
    """A converted tiny Llama: 4 attention heads, 2 KV heads, 6 layers (toolkit/tinymodels.py)."""
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("slurm-model")
    hf = make_tiny_model("llama", root / "hf", dtype="float32")
    return hf_to_megatron(hf, root / "mc", progress=False)


def test_layout_the_converter_refuses_is_refused_for_the_recipes_checkpoint(recipe_file, four_head_checkpoint):
    """TP 8 on a 4-head model: `convert` refuses it, so must render (same check, Layout.check)."""
    job = cpu_job(recipe_file, overrides=(f"model.checkpoint={four_head_checkpoint}", "parallel.tp=8",
                                          "parallel.pp=1", "global_batch=16"),
                  resources=Resources(nodes=1, gpus_per_node=8))
    with pytest.raises(SlurmError, match="4 attention heads are not divisible by parallel.tp=8"):
        render(job)
    ok = dataclasses.replace(job, overrides=(f"model.checkpoint={four_head_checkpoint}", "parallel.tp=2"))
    assert "NPROC_PER_NODE=8" in render(ok)


def test_explicit_model_option_checks_the_layout_when_the_checkpoint_is_elsewhere(recipe_file, tmp_path):
    from toolkit.tinymodels import make_config

    make_config("llama").to_json_file(tmp_path / "config.json")
    job = cpu_job(recipe_file, resources=Resources(nodes=1, gpus_per_node=8), overrides=("parallel.tp=8",
                                                                                          "parallel.pp=1"))
    render(job)  # the recipe's checkpoint "ckpt" does not exist here: nothing to check against
    with pytest.raises(SlurmError, match="4 attention heads are not divisible by parallel.tp=8"):
        render(dataclasses.replace(job, model=str(tmp_path / "config.json")))
    with pytest.raises(SlurmError, match="expected an HF model directory, a config.json, or a converted checkpoint"):
        render(dataclasses.replace(job, model=str(tmp_path / "missing")))


def test_cli_model_option_refuses_the_layout_in_one_line(recipe_file, tmp_path):
    from toolkit.tinymodels import make_config

    make_config("llama").to_json_file(tmp_path / "config.json")
    out = tmp_path / "job.sbatch"
    result = toolkit("slurm", "render", str(recipe_file), "parallel.tp=8", "parallel.pp=1", "--gpus-per-node", "8",
                     "--model", str(tmp_path / "config.json"), "-o", str(out), check=False)
    assert result.returncode == 2 and not out.exists(), result.stderr
    assert result.stderr.strip().count("\n") == 0 and "4 attention heads are not divisible by parallel.tp=8" in result.stderr


# ------------------------------------------------------------------------------------ working directory


def test_script_runs_the_same_whatever_directory_sbatch_runs_from(tmp_path, monkeypatch):
    """Rendered from one directory with relative paths, run from another: the trainer gets absolute
    config and script paths and runs in the render directory, where the recipe's own relative paths
    (model.checkpoint, data files, run_dir) point."""
    project = tmp_path / "project"
    (project / "recipes").mkdir(parents=True)
    (project / "recipes" / "r.yaml").write_text(yaml.safe_dump({"model": {"checkpoint": "ckpt"}, "data": {"train_file": "train.jsonl"},
                                                                "parallel": {"tp": 1, "pp": 1}, "global_batch": 4}))
    recorder = _executable(project / "recorder.sh", f"""#!/bin/bash
{{ printf '%s\\0' "$PWD" "$@"; }} > {shlex.quote(str(tmp_path / 'argv.bin'))}
""")
    (project / "train.py").write_text("")
    monkeypatch.chdir(project)
    script = write(cpu_job(Path("recipes/r.yaml"), launch=Launch(python="./recorder.sh", script="train.py")),
                   "job.sbatch")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_with_stand_ins(project / script, tmp_path, cwd=elsewhere)
    cwd, *argv = (tmp_path / "argv.bin").read_bytes().decode().split("\0")[:-1]
    assert cwd == str(project)
    tail = argv[argv.index(str(project / "train.py")):]
    assert tail == [str(project / "train.py"), "--config", str(project / "recipes" / "r.yaml"), "resume=auto"]
    assert f"#SBATCH --output={project}/%x-%j.out\n" in script.read_text()  # sbatch opens it before the script runs


def test_relative_log_path_that_cannot_sit_on_an_sbatch_line_is_refused(recipe_file, tmp_path, monkeypatch):
    (tmp_path / "a b").mkdir()
    monkeypatch.chdir(tmp_path / "a b")
    with pytest.raises(SlurmError, match="give an absolute --output"):
        render(cpu_job(recipe_file))
    assert f"--output={tmp_path}/log-%j.out" in render(cpu_job(recipe_file, output=f"{tmp_path}/log-%j.out"))


def test_min_nodes_renders_a_node_range_and_every_count_in_it_must_fit(recipe_file, tmp_path):
    """--min-nodes 1 --max-nodes 2: `#SBATCH --nodes=1-2`, each count checked with the recipe's TP x PP
    and global batch; a range holding a count that cannot run is one line naming the counts that can."""
    job = cpu_job(recipe_file, overrides=("parallel.pp=1",),
                  resources=Resources(nodes=2, min_nodes=1, procs_per_node=2, cpus_per_task=2, time="30"))
    text = render(job)
    assert "#SBATCH --nodes=1-2\n" in text and "--min-nodes=1" in text.splitlines()[2]
    assert "# Fine-tuning on 1 to 2 CPU node(s)" in text
    assert "#SBATCH --ntasks-per-node" not in text, "Slurm would size the job for MIN nodes"
    with pytest.raises(SlurmError, match=r"on 1 nodes x 2 processes \(within --min-nodes 1 --max-nodes 2\): 2 is not "
                                         r"divisible by the recipe's TP x PP = 2 x 2; node counts up to 2 that fit: \[2\]$"):
        render(dataclasses.replace(job, overrides=()))
    with pytest.raises(SlurmError, match="min_nodes must be a whole number from 1 to 2"):
        render(replace_in(job, "resources.min_nodes", 3))
    cli = toolkit("slurm", "render", str(recipe_file), "parallel.pp=1", "--cpu", "--min-nodes", "1", "--max-nodes", "2",
                  "--procs-per-node", "2", "--cpus-per-task", "2", "-o", str(tmp_path / "job.sbatch"))
    assert "#SBATCH --nodes=1-2\n" in (tmp_path / "job.sbatch").read_text(), cli.stdout
