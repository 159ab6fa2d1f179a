"""`toolkit parity`: does megatron-core train like HF on *my* model and data?

N steps of the user's recipe run twice: (a) the recipe itself (recipes/finetune.py, megatron-core
at the recipe's layout, launched as `toolkit quickstart` launches it), and (b) the HF model the
checkpoint was converted from, with torch AdamW in one process (toolkit/parity/reference.py, which
shares no code with the trainer). Both in fp32 on the same global batches in the same order; the
per-step losses and gradient norms are compared (toolkit/parity/verdict.py).

    from toolkit.parity import ParityRequest, run_parity
    verdict = run_parity(ParityRequest("recipe.yaml", ["parallel.tp=2"], steps=5))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import ParityError
from toolkit.parity.tolerances import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32

DEFAULT_STEPS = 5
DATA_LINES_CHECKED = 100  # before anything runs: the format is the file's, a sample of lines says it
# What parity sets on the user's recipe (after the user's overrides), and why.
FORCED = (
    "precision=fp32",  # both runs in fp32: a difference is then the conversion or the setup, not rounding
    "data.shuffle=false",  # the file's order, which the reference reads
    "data.valid_file=none", "data.valid_split=none",  # it compares training steps: no evaluation
    "resume=none", "export_hf=false", "save_every=0", "keep_last=1", "log_every=1", "wandb.enabled=false",
)

# fp32 means fp32 on a GPU too: TF32 matmuls keep a 10-bit mantissa, far above the fp32 bars (as docs/gpu_suite.md runs).
NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}


@dataclass
class ParityRequest:
    config: str  # the recipe YAML
    overrides: list[str] = field(default_factory=list)  # key.sub=value, as the recipe takes them
    steps: int = DEFAULT_STEPS
    hf: str | None = None  # the HF model the checkpoint was converted from (default: as its conversion recorded)
    nprocs: int | None = None  # processes of the megatron-core run (default TP x PP x EP: DP 1)
    workdir: str | None = None  # keep the megatron-core run there (default: a temporary directory, removed)
    loss_tolerance: float = LOSS_TOLERANCE_FP32
    norm_tolerance: float = GRAD_NORM_TOLERANCE  # relative
    launcher: list[str] | None = None  # what starts the ranks, as torchrun's arguments before the script
    shrink_layers: int | None = None  # compare on a copy of the HF model's first N layers, converted again


@dataclass
class ParityPlan:
    """What `plan` checked: everything both runs need, before anything is written."""

    request: ParityRequest
    cfg: object  # toolkit.train.config.TrainConfig, with FORCED applied
    hf_dir: Path
    nprocs: int
    device: str  # where the reference runs
    overrides: list[str]  # the user's, then FORCED and the steps
    num_layers: int  # the model's

    def header(self) -> list[str]:
        p, cfg = self.cfg.parallel, self.cfg
        dp = self.nprocs // (p.tp * p.pp)
        processes = f"{self.nprocs} process{'es' if self.nprocs > 1 else ''}"
        lines = [f"toolkit parity: {self.request.steps} steps of {self.request.config} on megatron-core (TP {p.tp} x PP "
                 f"{p.pp} x DP {dp}, {processes}) against the HF model {self.hf_dir} with torch AdamW in one process "
                 f"on {self.device}",
                 f"  both in fp32, on data read in file order (data.shuffle=false), global batch {cfg.global_batch}, "
                 f"the LR schedule over these {self.request.steps} steps; no evaluation, no export"]
        if self.request.shrink_layers:
            lines.append(f"  ON A SHRUNK COPY: the first {self.request.shrink_layers} of the model's {self.num_layers} "
                         f"layers, converted again by this toolkit at TP {p.tp} x PP {p.pp}: it checks the conversion of "
                         f"this config and the training setup, not the files of {cfg.model.checkpoint}")
        return lines


def plan(request: ParityRequest) -> ParityPlan:
    """Every check that needs no run: the recipe, the checkpoint, the HF model, the data, whether the
    reference fits. A problem is one ParityError (or ConfigError, ConversionError) line."""
    import torch

    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.train.config import load_config

    if request.steps < 1:
        raise ParityError(f"--steps must be at least 1, not {request.steps}")
    overrides = [*request.overrides, *FORCED, f"steps={request.steps}"]
    cfg = load_config(request.config, overrides)
    meta = CheckpointMeta.read(Path(cfg.model.checkpoint))
    spec = meta.model_spec
    _refuse_unsupported(cfg, spec)
    if request.shrink_layers is not None and cfg.peft.enabled:
        raise ParityError("--shrink-layers compares full fine-tuning only: the adapter holds weights of every layer")
    hf_dir = _hf_dir(request.hf, meta.hf_source, cfg.model.checkpoint)
    _check_data(cfg, hf_dir)
    per_replica = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.ep
    nprocs = request.nprocs or per_replica
    if nprocs % per_replica:
        raise ParityError(f"--nprocs {nprocs} is not a multiple of TP x PP x EP = {per_replica}, the recipe's layout")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _refuse_unless_fits(request, cfg, spec, device)
    return ParityPlan(request, cfg, hf_dir, nprocs, device, overrides, spec.num_layers)


def _refuse_unless_fits(request: ParityRequest, cfg, spec, device: str) -> None:
    """The reference, of the model or of its shrunk copy, fits the free memory; if not, the refusal
    names the --shrink-layers that would."""
    from toolkit.memory.params import total_params
    from toolkit.parity import shrink
    from toolkit.parity.fit import free_bytes, reference_bytes, refuse_unless_fits

    p = cfg.parallel
    if request.shrink_layers is not None:
        shrink.check_layers(spec, request.shrink_layers, p.pp, p.vpp)
        spec = shrink.shrunk_spec(spec, request.shrink_layers)
    free = free_bytes(device)

    def needs(s) -> int:
        return reference_bytes(s, cfg.data.seq_len, cfg.global_batch)

    if needs(spec) <= free:
        return
    layers = shrink.layers_that_fit(spec, lambda s: needs(s) <= free, p.pp, p.vpp)
    hint = f"--shrink-layers {layers} (a copy of its first {layers} layers) fits" if layers else None
    refuse_unless_fits(needs(spec), free, device, total_params(spec), hint)


def _refuse_unsupported(cfg, spec) -> None:
    if spec.is_moe:
        raise ParityError("toolkit parity compares dense models only for now: the router's auxiliary loss of an MoE "
                          "model has no reference here yet")
    if cfg.model.optimizer_state is not None:
        raise ParityError("model.optimizer_state starts from a Megatron-LM run's Adam state, which the HF reference "
                          "cannot start from: give model.optimizer_state=none")
    if cfg.peft.enabled and cfg.peft.init_from is None:
        raise ParityError("a LoRA recipe needs peft.init_from=ADAPTER_DIR (an HF PEFT adapter) so that both runs start "
                          "from the same adapter weights; a fresh adapter's random A cannot be drawn the same in both")


def _hf_dir(given: str | None, recorded: str | None, checkpoint: str) -> Path:
    hf = given or recorded
    if hf is None:
        raise ParityError(f"{checkpoint} does not record the HF model it was converted from: give --hf DIR")
    hf_dir = Path(hf)
    if not (hf_dir / "config.json").is_file():
        source = "--hf" if given else f"the HF model {checkpoint} was converted from"
        raise ParityError(f"{hf_dir} ({source}) is not an HF model directory (no config.json): give --hf DIR, the HF "
                          "model the checkpoint was converted from")
    return hf_dir


def _check_data(cfg, hf_dir: Path) -> None:
    """The reference reads one local JSONL file of prompt/response, messages or text records."""
    from toolkit.parity.reference import encode_record, reference_tokenizer

    data = cfg.data
    path = Path(data.train_file)
    if "," in data.train_file or data.weights is not None or not path.is_file():
        raise ParityError(f"data.train_file={data.train_file}: toolkit parity reads one local JSONL file (not a mixture, "
                          "a saved dataset or a Hub name); point data.train_file at a JSONL sample of your data")
    tokenizer = reference_tokenizer(hf_dir, data.chat_template)
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                encode_record(tokenizer, record, dataclasses.asdict(data.columns))
            except ValueError as e:  # json.JSONDecodeError is one; so is a tokenizer without a chat template
                raise ParityError(f"{path}:{number}: {str(e).splitlines()[0]}") from None
            if number >= DATA_LINES_CHECKED:
                break


def run_parity(request: ParityRequest, log=print) -> "Verdict":  # noqa: F821 - toolkit.parity.verdict
    """Both runs and their verdict (also logged, with the side-by-side table)."""
    from toolkit.parity.reference import hf_reference
    from toolkit.parity.verdict import judge
    from toolkit.runtime.recipe_launch import launch_recipe

    checked = plan(request)
    for line in checked.header():
        log(line)
    workdir = _workdir(request.workdir)
    try:
        overrides, hf_dir = [*checked.overrides, f"run_dir={workdir / 'megatron-run'}"], checked.hf_dir
        if request.shrink_layers:
            log(f"[0/2] shrinking {hf_dir} to its first {request.shrink_layers} layers and converting the copy")
            hf_dir, checkpoint = _shrunk_copy(checked, workdir)
            overrides += [f"model.checkpoint={checkpoint}", "model.num_layers=none"]
        run_dir = workdir / "megatron-run"
        log(f"[1/2] the recipe on megatron-core ({run_dir})")
        launch_recipe(checked.nprocs, Path(request.config), overrides, run_dir, launcher=request.launcher,
                      capture=True, env=NO_TF32)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Loading weights" bar would cut into the table
        log(f"[2/2] the HF reference ({hf_dir}, torch AdamW, {checked.device})")
        with _tf32_off():
            losses, norms = hf_reference(hf_dir, Path(checked.cfg.data.train_file), checked.cfg.to_dict(),
                                         request.steps, device=checked.device,
                                         adapter=checked.cfg.peft.init_from if checked.cfg.peft.enabled else None)
    finally:
        if request.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    verdict = judge(metrics, losses, norms, request.loss_tolerance, request.norm_tolerance)
    for line in verdict.table():
        log("  " + line)
    log(verdict.summary())
    if request.shrink_layers:
        log(f"(on a shrunk copy of the model: its first {request.shrink_layers} of {checked.num_layers} layers)")
    return verdict


def _shrunk_copy(checked: ParityPlan, workdir: Path) -> tuple[Path, Path]:
    """(the HF copy of the first N layers, its conversion at the recipe's TP x PP) under `workdir`."""
    from toolkit.convert import hf_to_megatron
    from toolkit.parity.shrink import shrink_hf

    hf_dir = shrink_hf(checked.hf_dir, workdir / "hf-shrunk", checked.request.shrink_layers)
    p = checked.cfg.parallel
    return hf_dir, Path(hf_to_megatron(hf_dir, workdir / "megatron-shrunk", tp=p.tp, pp=p.pp, progress=False))


@contextlib.contextmanager
def _tf32_off():
    """The reference in this process with torch's TF32 switches off (cuDNN's is on by default), then as they were."""
    import torch

    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


def _workdir(given: str | None) -> Path:
    if given is None:
        return Path(tempfile.mkdtemp(prefix="toolkit-parity-"))
    path = Path(given).absolute()
    if path.exists() and any(path.iterdir()):
        raise ParityError(f"--workdir {path} is not empty: give a new or empty directory")
    path.mkdir(parents=True, exist_ok=True)
    return path
