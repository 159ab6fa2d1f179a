"""Training checkpoints that are never torn, resumable exactly, and exportable to HF.

    RUN_DIR/checkpoints/
      latest                      name of the newest complete checkpoint (replaced atomically)
      step_0000010/
        ds/                       DeepSpeed's save_checkpoint: its model-states file (module, engine
                                  counters, LR scheduler); its ZeRO optimizer files only with LoRA
        fsdp/                     instead, under parallel.dp_engine=fsdp: torch.distributed.checkpoint of the
                                  sharded model and AdamW (tp_XX/ per TP rank) and the LR scheduler
        adapter/                  with LoRA instead of model/: the adapter as an HF PEFT directory,
                                  with the base checkpoint's path and checksum (toolkit_base.json)
        model/                    fp32 master weights in our per-rank `torch` format + conversion
                                  metadata and HF config/tokenizer: `toolkit convert megatron-to-hf` reads it
        ranks/rank_00003.pt       each rank's RNG states and data position (DeepSpeed's client_state
                                  is written by DP rank 0 only)
        train/                    layout-independent fp32 master weights and Adam moments
                                  (torch_dist, toolkit.train.elastic): what every full fine-tune resumes from
        train_state.json          step, layout, global batch, samples consumed, LR schedule, Adam step,
                                  DeepSpeed's step counters and fp16 loss scale

A full fine-tune resumes from `train/` on any TP x PP x DP x ZeRO, each rank reading only its own
slice; DeepSpeed's ZeRO files would hold the same fp32 state a second time, so they are not written
(the save costs about what DeepSpeed's own did). On the layout that wrote the checkpoint each rank's
RNG states and data position follow too, and the resume is bit-exact; on another the global batch is
kept (the micro-batches per step follow from the new DP) and the RNG states are re-seeded from the
config's seed (exact without dropout). A LoRA run resumes from DeepSpeed's files, on its own layout.

A checkpoint is written under .step_0000010.partial and renamed only after every rank finished
(DeepSpeed's own `latest` file is written by rank 0 without a barrier, so save_latest=False).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
# DCP's writers report failures as this BaseException (megatron-core 0.19's torch_dist writer on a full disk)
from torch.distributed.checkpoint.api import CheckpointException

from toolkit.atomic import fault_point, refuse_output_overlapping_inputs
from toolkit.convert import naming, torch_format
from toolkit.convert.metadata import HF_DIR, RELEASE, TRACKER, CheckpointMeta
from toolkit.errors import ReportedByAnotherRank, ToolkitError
from toolkit.families import BUFFERS
from toolkit.megatron_settings import megatron_args
from toolkit.train import engine_state
from toolkit.train.experts import restore_experts_from_masters
from toolkit.train.fsdp import FsdpEngine
from toolkit.train.schedule import LRSchedule

LATEST = "latest"
# Layout keys that checkpoints of earlier versions (or of runs without the feature) lack.
LAYOUT_DEFAULTS = {"vpp": 1, "cp": 1}
DS_TAG = "ds"
STEP_DIR = re.compile(r"step_(\d+)")
# What a run writes inside RUN_DIR.
CHECKPOINTS, HF_EXPORT, ADAPTER_EXPORT, METRICS = "checkpoints", "hf", "adapter", "metrics.jsonl"


class CheckpointError(ToolkitError):
    """A checkpoint cannot be saved or resumed."""


# After a failed write, less free space than this on the run's filesystem means it failed because
# the disk is full (torch.save reports "file write failed" without the errno).
DISK_FULL_BYTES = 1 << 20
# Beside a step's partial save: a rank has said that the disk filled during it (toolkit.train.checkpoint.save).
DISK_FULL_NOTE = ".disk_full"


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def _rank_states(source) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": list(random.getstate()[1]),
        "tracker": get_cuda_rng_tracker().get_states(),
        "data": source.state_dict(),
    }


def _restore_rank_states(state: dict, source) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate((3, tuple(state["python"]), None))
    get_cuda_rng_tracker().set_states(state["tracker"])
    source.load_state_dict(state["data"])


def _master_weights(module) -> dict[torch.nn.Parameter, torch.Tensor]:
    """fp32 master copy of every parameter (collective over DP under ZeRO), whole on every rank."""
    from toolkit.train import zero_gather

    params = list(module.parameters())
    return {params[index]: (params[index].detach() if full is None else full).float().cpu().clone()
            for index, full in zero_gather.full_states(params, None)}


def _write_model(step_dir: Path, module, masters: dict, source_meta: CheckpointMeta, source_dir: Path) -> None:
    """Our per-rank torch format with the fp32 master weights, so export needs only this checkpoint.
    With expert parallelism each EP rank writes its own experts (expert-DP rank 0 of each): DeepSpeed's
    model-states file, from DP rank 0 alone, holds only that rank's. With virtual stages each chunk
    is written as its stage of a PP x VPP pipeline (toolkit.train.virtual)."""
    from megatron.core import parallel_state as ps

    from toolkit.train.virtual import stages

    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    written = stages(module)
    pp = written[0][0]
    meta = CheckpointMeta(**{**source_meta.__dict__, "format": "torch", "layer_spec": "local", "tp": tp, "pp": pp, "ep": ep,
                             "master_weights": True})
    digests = []
    writer = ps.get_expert_data_parallel_rank() == 0  # one writer per (PP, EP) rank and its TP rank(s)
    args = megatron_args(meta.model_spec, meta.layout, "torch")
    layers = meta.model_spec.num_layers // pp
    local_experts = meta.model_spec.num_experts // ep
    for _, stage, chunk in written:
        canonical = naming.canonical_names(name for name, _ in chunk.named_parameters())
        weights = {canonical[name]: masters[param] for name, param in chunk.named_parameters()}
        # the expert bias is a buffer, not a parameter: as the model holds it, in float32 as megatron-core keeps it
        weights.update({naming.to_canonical(name): buffer.detach().to("cpu", torch.float32)
                        for name, buffer in chunk.named_buffers() if name.endswith(BUFFERS)})
        for tp_rank, rank_weights in _files_per_tp_rank(chunk, weights).items():
            if not writer:
                continue
            path = torch_format.rank_file(step_dir / "model" / RELEASE, meta.layout, tp_rank, stage,
                                          ps.get_expert_model_parallel_rank())
            digests.append((str(path.relative_to(step_dir / "model")),
                            torch_format.save_rank_file(path, rank_weights, args, "local", layers, local_experts)))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digests)
    if dist.get_rank() == 0:
        meta.checksums = dict(d for rank_digests in gathered for d in rank_digests)
        meta.write(step_dir / "model")
        (step_dir / "model" / TRACKER).write_text(RELEASE)
        shutil.copytree(source_dir / HF_DIR, step_dir / "model" / HF_DIR)


def _files_per_tp_rank(chunk, weights: dict) -> dict[int, dict]:
    """{TP rank: weights} of the per-rank files this rank's (PP, EP) rank writes: its own at expert TP =
    TP. At expert TP 1 under TP > 1 the EP ranks are TP ranks (toolkit.train.build.check_expert_layout),
    so no rank holds TP rank t's shard with another TP rank's experts, while the format keeps one file per
    (TP, PP, EP): the file of every TP rank gets this rank's experts, whole, with that TP rank's other
    weights, gathered over TP (collective: every rank calls it)."""
    from megatron.core import parallel_state as ps

    from toolkit.train.experts import is_expert

    tp = ps.get_tensor_model_parallel_world_size()
    if not ps.get_expert_tensor_parallel_world_size() == 1 < tp:
        return {ps.get_tensor_model_parallel_rank(): weights}
    experts = {naming.to_canonical(name) for name, param in chunk.named_parameters() if is_expert(param)}
    shards = [None] * tp
    dist.all_gather_object(shards, {k: v for k, v in weights.items() if k not in experts},
                           group=ps.get_tensor_model_parallel_group())
    own = {k: v for k, v in weights.items() if k in experts}
    return {tp_rank: {**shard, **own} for tp_rank, shard in enumerate(shards)}


def save(run_dir: Path, step: int, engine, module, shards, source, train_state: dict, source_meta, source_dir,
         keep_last: int, adapter=None) -> Path:
    """Collective: every rank calls it. `train_state` (the layout, the LR schedule, the global
    batch) goes into train_state.json, where a resume checks it before any process group exists.
    With a LoRA `adapter` the frozen base is not saved: it stays in source_dir, which the adapter
    names, and the adapter resumes on its own layout only (no layout-independent state)."""
    from toolkit.train import elastic

    root = Path(run_dir) / CHECKPOINTS
    final = root / step_name(step)
    tmp = root / f".{step_name(step)}.partial"
    reported = root / f".{step_name(step)}{DISK_FULL_NOTE}"
    try:
        if dist.get_rank() == 0:
            fault_point("checkpoint-start")  # tests: fill the disk while the run waits here
            shutil.rmtree(tmp, ignore_errors=True)
            for note in root.glob(f".*{DISK_FULL_NOTE}"):  # an earlier run's, told and done with
                note.unlink(missing_ok=True)
            (tmp / "ranks").mkdir(parents=True)
        dist.barrier()
        lora = adapter is not None
        _save_deepspeed(engine, tmp, optimizer_files=lora, exclude_frozen=lora)
        fsdp = isinstance(engine, FsdpEngine)
        if adapter is None:
            masters = engine.master_weights() if fsdp else _master_weights(module)  # every rank takes part in the DP collectives
            _write_model(tmp, module, masters, source_meta, Path(source_dir))
        else:
            from toolkit.lora.adapter import save_adapter

            save_adapter(adapter, tmp / ADAPTER_EXPORT)
        torch.save(_rank_states(source), tmp / "ranks" / f"rank_{dist.get_rank():05d}.pt")
        if shards is not None:  # not for an adapter, nor under FSDP (which resumes on its own layout)
            elastic.save_state(tmp / elastic.STATE_DIR, engine, shards)
        resumable = {"consumed_samples": source.state_dict()["consumed"],
                     "adam_step": engine.adam_step() if fsdp else elastic.adam_step(engine),
                     "last_lr": [float(g["lr"]) for g in engine.optimizer.param_groups], **engine_state.read(engine)}
        if dist.get_rank() == 0:
            (tmp / "train_state.json").write_text(json.dumps({"step": step, **train_state, **resumable}, indent=2))
        dist.barrier()  # every rank's files are on disk
        if dist.get_rank() == 0:
            fault_point("checkpoint-before-marker")
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            marker = root / f".{LATEST}.tmp"
            marker.write_text(final.name)
            os.replace(marker, root / LATEST)
            _prune(root, keep_last, step)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any writer's failure on a full disk is the same story
        told = _told_disk_full(e, root, tmp, final, reported)
        if told is None:
            raise
        raise told from None
    dist.barrier()
    return final


def _told_disk_full(error: BaseException, root: Path, tmp: Path, final: Path, note: Path) -> ToolkitError | None:
    """What a rank whose save failed raises when the disk filled: the one line (the first rank to
    report), or a silent ReportedByAnotherRank; None when the disk is not why it failed.

    The first rank claims `note` before it removes the partial save: a rank that looks after the
    removal sees free space (and DCP words a short write as "unexpected pos", without the errno),
    so the note must already be there for it to stay silent."""
    silent = ReportedByAnotherRank(f"{final.name}: the disk is full")
    if not _disk_full(error, root):
        return silent if note.exists() else None  # a collective broke because the rank that hit the full disk has left
    first = _first_to_report(note)
    told = _disk_full_error(root, tmp, final)  # removes the partial save
    if not note.exists():  # there was no room even for the note: now there is
        _first_to_report(note)
    return told if first else silent


def _first_to_report(note: Path) -> bool:
    """Several ranks may hit the full disk, and the others then fail in a collective that rank left:
    the first to create `note` on the shared checkpoint directory says the one line (the note
    outlives it, so that the ranks whose collective breaks when it exits know to stay silent)."""
    try:
        os.close(os.open(note, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:  # no room even for the note: better a line from each rank than none
        return True


def _disk_full(error: BaseException, root: Path) -> bool:
    pending = [error]
    while pending:
        seen = pending.pop()
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) or "No space left on device" in str(seen):
            return True
        pending += [e for e in (seen.__cause__ or seen.__context__,) if e is not None]
        for failure in getattr(seen, "failures", {}).values():  # DCP's, by rank: (exception, traceback)
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, BaseException):
                pending.append(failure)
    try:
        return shutil.disk_usage(root).free < DISK_FULL_BYTES
    except OSError:
        return False


def _bytes_under(path: Path) -> int:
    """What the files under `path` hold; files another rank removes meanwhile (each rank that hits a
    full disk removes the partial save) count as gone."""
    total = 0
    try:
        for f in Path(path).rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                total += f.stat().st_size if f.is_file() else 0
    except FileNotFoundError:
        pass
    return total


def _disk_full_error(root: Path, tmp: Path, final: Path) -> CheckpointError:
    """One line: what the save needed, what is free, and that nothing was lost. The partial save
    is removed (every rank may try; the first one does it) so that the disk is as it was."""
    from toolkit.units import size

    written = _bytes_under(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    previous = _step_dirs(root)
    if previous:
        newest = previous[max(previous)]
        needed = f"about {size(_bytes_under(newest))} (the size of {newest.name})"
    else:
        needed = f"more than the {size(written)} it had written"
    marker = root / LATEST
    kept = f"{LATEST} still names {marker.read_text().strip()}" if marker.is_file() else "no checkpoint was written before"
    free = shutil.disk_usage(root).free
    return CheckpointError(f"the disk under {root} is full: saving {final.name} needs {needed}, and {size(free)} are "
                           f"free; nothing was lost ({kept}, the partial save is removed): free space or move run_dir, "
                           "then continue with resume=auto")


def _save_deepspeed(engine, directory: Path, optimizer_files: bool, exclude_frozen: bool) -> None:
    """DeepSpeed's model-states file (module, engine counters, LR scheduler) and, with
    `optimizer_files`, its ZeRO optimizer files. A full fine-tune leaves those out: train/ holds the
    same fp32 master weights and Adam moments, and every resume reads them from there."""
    zero_files = getattr(engine, "save_zero_checkpoint", False)  # DeepSpeed's choice of the ranks writing them
    if zero_files:
        engine.save_zero_checkpoint = optimizer_files
    try:
        engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=exclude_frozen)
    finally:
        if zero_files:
            engine.save_zero_checkpoint = zero_files


def _step_dirs(root: Path) -> dict[int, Path]:
    """Complete checkpoint directories by step number (partial ones start with a dot)."""
    found = {}
    for path in root.glob("step_*"):
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def _prune(root: Path, keep_last: int, latest_step: int) -> None:
    """Keep the `keep_last` newest checkpoints up to the one `latest` names, by step number.
    Never the one `latest` names, nor any newer one (they are not ours to judge)."""
    found = _step_dirs(root)
    older = sorted(step for step in found if step <= latest_step)
    for step in older[: max(0, len(older) - keep_last)]:
        if step != latest_step:
            shutil.rmtree(found[step], ignore_errors=True)


def refuse_outputs_over_inputs(run_dir: Path, *inputs) -> None:
    """What a run replaces (its checkpoints, the HF export, the metrics) must not be, contain or lie
    inside what it reads (the model checkpoint, the data files)."""
    for output in (CHECKPOINTS, HF_EXPORT, ADAPTER_EXPORT, METRICS):
        refuse_output_overlapping_inputs(Path(run_dir) / output, *inputs)


def refuse_used_run_dir(run_dir: Path, resume: str) -> None:
    """A fresh run (resume=none) must not write into another run's directory: its pruning,
    `latest` and metrics.jsonl would mix with or destroy the other run's."""
    if resume != "none":
        return
    run_dir = Path(run_dir)
    found = [p.name for p in (run_dir / CHECKPOINTS, run_dir / METRICS) if p.exists()]
    if found:
        marker = run_dir / CHECKPOINTS / LATEST
        latest = f" (latest: {marker.read_text().strip()})" if marker.is_file() else ""
        raise CheckpointError(
            f"run_dir {run_dir} already holds another run's {' and '.join(found)}{latest}: continue it with "
            "resume=auto, or give a new or empty run_dir"
        )


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names (partial ones never are)."""
    marker = Path(run_dir) / CHECKPOINTS / LATEST
    if not marker.is_file():
        return None
    path = marker.parent / marker.read_text().strip()
    if not (path / "train_state.json").is_file():
        raise CheckpointError(f"{marker} names {path.name}, which is incomplete or missing")
    return path


def find_resumable(run_dir: Path, say=print):
    """resume=auto: the checkpoint `latest` names or, when one of its files is damaged, the newest
    older checkpoint whose files are intact (toolkit.train.checkpoint_verify), saying so with `say`;
    one line naming the damaged file when there is none. Returns it as checked (an Intact, whose
    train_state.json and train/ index check_resumable reads no more), or None."""
    from toolkit.train.checkpoint_verify import Damaged, intact

    latest = find_latest(run_dir)
    if latest is None:
        return None
    try:
        return intact(latest)
    except Damaged as e:
        problem = str(e)
    match = STEP_DIR.fullmatch(latest.name)
    for step, older in sorted(_step_dirs(latest.parent).items(), reverse=True):
        if not match or step >= int(match.group(1)):
            continue
        try:
            checked = intact(older)
        except Damaged:
            continue
        say(f"warning: {latest.name} is damaged ({problem}); resuming from {older.name}, the newest intact checkpoint")
        return checked
    raise CheckpointError(f"{latest.name}, the latest checkpoint, is damaged ({problem}) and no older one is intact: "
                          "restore the file, or start again in a new run_dir")


def refuse_damaged(path: Path):
    """An explicitly named checkpoint (resume=PATH) whose files are damaged is one line; else it as
    checked (an Intact)."""
    from toolkit.train.checkpoint_verify import Damaged, intact

    try:
        return intact(Path(path))
    except Damaged as e:
        raise CheckpointError(f"resume={path}: the checkpoint is damaged ({e})") from None


def _train_state(path: Path) -> dict:
    try:
        state = json.loads((path / "train_state.json").read_text())
        int(state["step"])
        return state
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path / 'train_state.json'} is unreadable ({e}): not a complete checkpoint") from None


def check_resumable(checked, layout: dict, requested_schedule, meta: CheckpointMeta, global_batch: int,
                    lora: bool = False, base_checkpoint=None) -> bool:
    """Everything a resume from `checked` (the Intact checkpoint find_resumable or refuse_damaged
    returned) needs that can be checked before training. Returns True when the checkpoint was
    written on this very layout (DeepSpeed's files resume it exactly). A LoRA run resumes only from
    a LoRA checkpoint of the same base checkpoint (by checksum)."""
    from toolkit.train import elastic

    path, state = checked.path, checked.state
    step = int(state["step"])
    _check_same_kind(path, lora, base_checkpoint)
    if not lora:  # a LoRA checkpoint names its base by checksum instead (checked above)
        _check_same_model(path, meta)
    saved = {k: state.get(k, LAYOUT_DEFAULTS.get(k)) for k in layout}
    # cp is in a layout only when > 1: a CP checkpoint resumed without CP (or with another) is another layout
    same_layout = saved == layout and state.get("cp", 1) == layout.get("cp", 1)
    if not same_layout:
        if lora:
            overrides = " ".join(f"parallel.{k}={saved[k]}" for k in ("tp", "pp", "zero_stage") if k in saved)
            processes = math.prod(saved.get(k) or 1 for k in ("tp", "pp", "cp", "dp"))
            raise CheckpointError(
                f"{path} is a LoRA checkpoint written with {saved}: an adapter resumes on that layout only, not on "
                f"{layout}. Resume it with {overrides} on {processes} processes, or start a new run_dir on this "
                f"layout from its adapter: peft.init_from={path / ADAPTER_EXPORT} (a fresh optimizer and schedule)")
        if "fsdp" in (state.get("dp_engine"), layout.get("dp_engine")):  # saved's keys are the requested layout's
            raise CheckpointError(f"{path} was written with {saved}: a checkpoint resumes across the DeepSpeed and "
                                  f"FSDP engines, or on another FSDP layout, not at all yet; resume on {saved}")
        if "consumed_samples" not in state:
            raise CheckpointError(f"{path} was written with {saved} by an earlier version without a layout-independent "
                                  f"state: resume it on that layout, not on {layout}")
    if checked.train_index is None and not same_layout:  # every resume but a LoRA one reads it: one line
        elastic.check_files(path / elastic.STATE_DIR)
    if state.get("global_batch", global_batch) != global_batch:
        raise CheckpointError(f"{path} was trained with global_batch {state['global_batch']}, this run asks for "
                              f"{global_batch}: a resumed run keeps its global batch (set global_batch={state['global_batch']})")
    if "lr_schedule" in state:  # checkpoints of earlier versions carry none: the config's is used
        LRSchedule.from_state(state["lr_schedule"]).continue_as(requested_schedule, step, checkpoint=path)
    return same_layout


def _check_same_kind(path: Path, lora: bool, base_checkpoint) -> None:
    has_adapter = (path / ADAPTER_EXPORT).is_dir()
    if has_adapter != lora:
        raise CheckpointError(f"{path} is a {'LoRA' if has_adapter else 'full'} fine-tuning checkpoint, this run is "
                              f"{'LoRA' if lora else 'a full fine-tune'} (peft.enabled={str(lora).lower()})")
    if lora:
        from toolkit.lora.peft_dir import check_base

        check_base(path / ADAPTER_EXPORT, Path(base_checkpoint))


def _check_same_model(path: Path, meta: CheckpointMeta) -> None:
    """The checkpoint's model (architecture, vocabulary, heads, ...) must be the run's."""
    try:
        saved = CheckpointMeta.read(path / "model").spec
    except ToolkitError as e:
        raise CheckpointError(f"{path} holds no readable model description: {e}") from None
    changed = [f"{k} {saved.get(k)} -> {v}" for k, v in meta.spec.items() if saved.get(k) != v]
    if changed:
        raise CheckpointError(f"{path} is a checkpoint of another model ({', '.join(changed[:4])}): "
                              "resume only the model it was trained from, or start a new run_dir")


def resume(path: Path, engine, source, schedule, requested_schedule, shards, same_layout: bool, lora: bool = False) -> int:
    """Load a checkpoint written by `save` (check_resumable has accepted it); returns its step.
    The LR schedule restored from it goes on as `requested_schedule` asks."""
    from toolkit.train import elastic

    state = _train_state(path)
    step = int(state["step"])
    if (path / elastic.STATE_DIR).is_dir():
        _resume_from_train_state(path, state, engine, source, schedule, shards, same_layout)
    else:  # a LoRA checkpoint, or one of an earlier version: DeepSpeed's files, on their own layout
        _resume_deepspeed(path, engine, source, lora)
    schedule.continue_as(requested_schedule, step, checkpoint=path)
    return step


def _resume_deepspeed(path: Path, engine, source, lora: bool) -> None:
    # A LoRA checkpoint holds the adapter only: the frozen base is already loaded from its own checkpoint.
    load_path, _ = engine.load_checkpoint(str(path), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
                                          load_module_strict=not lora)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load {path / DS_TAG}")
    restore_experts_from_masters(engine.module)  # DeepSpeed's model file has DP rank 0's experts only
    _restore_rank_states(torch.load(_rank_file(path), weights_only=True), source)


def _rank_file(path: Path) -> Path:
    return path / "ranks" / f"rank_{dist.get_rank():05d}.pt"


def _resume_from_train_state(path: Path, state: dict, engine, source, schedule, shards, same_layout: bool) -> None:
    """Weights and Adam's state from `train/` (each rank reading its own slice, on any layout), the
    LR schedule, the engine's counters and loss scale from train_state.json; on the layout that wrote
    the checkpoint each rank's RNG states and data position too (bit-exact), on another the data
    position in samples (global) and RNG states re-seeded from the config."""
    from toolkit.train import elastic

    step = int(state["step"])
    elastic.load_state(path / elastic.STATE_DIR, engine, shards, int(state["adam_step"]))
    vars(schedule).update(state["lr_schedule"])  # the LambdaLR's own callable
    scheduler = engine.lr_scheduler
    scheduler.last_epoch = step
    last_lr = _group_lrs(state["last_lr"], len(engine.optimizer.param_groups))
    for group, lr in zip(engine.optimizer.param_groups, last_lr, strict=True):
        group["lr"] = lr
    scheduler._last_lr = last_lr
    engine_state.restore(engine, state)
    if same_layout:
        _restore_rank_states(torch.load(_rank_file(path), weights_only=True), source)
    else:
        source.load_state_dict({"consumed": state["consumed_samples"]})


def _group_lrs(saved: list[float], groups: int) -> list[float]:
    """Each parameter group's LR. Expert parallelism adds a group for the experts (their own DP
    group), so a resume across EP sizes has another number of groups: one schedule drives them all."""
    if len(saved) == groups:
        return list(saved)
    if len(set(saved)) != 1:
        raise CheckpointError(f"the checkpoint's {len(saved)} parameter groups have different LRs {saved}: "
                              f"they cannot be given to this layout's {groups}")
    return saved[:1] * groups


# Files of the checkpoint's hf/ directory that are not the tokenizer's: an adapter directory holds
# the tokenizer (AutoTokenizer.from_pretrained(adapter)), never a model config of its own.
NOT_TOKENIZER_FILES = ("config.json", "generation_config.json")


def export_adapter(run_dir: Path, tokenizer_from: Path | None = None) -> Path:
    """The latest checkpoint's adapter copied to RUN_DIR/adapter (replacing an older export whole),
    with the tokenizer files of `tokenizer_from` (the base checkpoint's hf/ directory)."""
    out = Path(run_dir) / ADAPTER_EXPORT
    tmp = Path(run_dir) / f".{ADAPTER_EXPORT}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(find_latest(run_dir) / ADAPTER_EXPORT, tmp)
    if tokenizer_from is not None and Path(tokenizer_from).is_dir():
        for path in sorted(Path(tokenizer_from).iterdir()):
            if path.is_file() and path.name not in NOT_TOKENIZER_FILES:
                shutil.copy2(path, tmp / path.name)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out
