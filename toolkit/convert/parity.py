"""`toolkit convert verify`: run a converted checkpoint in megatron-core on TP x PP processes and
compare it with the HF model on the same tokens.

The parent process runs the HF model (the independent reference) and records its logits and
every decoder layer's output. Workers load the megatron checkpoint, run the same tokens through
the pipeline stages, and report per-layer and logit differences over the true vocab (padding
sliced off). Several checkpoints can be checked in one launch (`verify_many`).
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.convert.metadata import CheckpointMeta, bad_checksums
from toolkit.convert.progress import Stages
from toolkit.errors import VerificationError
from toolkit.layouts import Layout

# Max |logit difference| accepted per compute dtype. fp32 is what the parity tests demand;
# bf16/fp16 round every matmul, so differences of a few hundredths are expected there.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
DEFAULT_SEQ_LEN = 32
DEFAULT_BATCH = 2
# Stage lines of a verify run: 1 HF reference, 2 launch, 3 load shards, 4 forward, 5 compare.
VERIFY_STAGES = 5


@dataclass
class Report:
    checkpoint: str
    dtype: str
    max_logit_diff: float
    top1_agreement: float
    layer_diffs: list[float]
    bad_files: list[str] = field(default_factory=list)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    @property
    def first_divergent_layer(self) -> int | None:
        return next((i for i, d in enumerate(self.layer_diffs) if d > self.tolerance), None)

    @property
    def ok(self) -> bool:
        return not self.bad_files and self.max_logit_diff <= self.tolerance and self.first_divergent_layer is None

    def lines(self) -> list[str]:
        out = [
            f"checkpoint        {self.checkpoint}",
            f"max |dlogit|      {self.max_logit_diff:.3e}  (tolerance {self.tolerance:.0e} in {self.dtype}, true vocab only)",
            f"top-1 agreement   {self.top1_agreement * 100:.2f}%",
            f"worst layer diff  {max(self.layer_diffs):.3e}",
        ]
        first = self.first_divergent_layer
        out.append(f"first divergent   {'none' if first is None else f'layer {first}'}")
        if self.bad_files:
            out.append(f"checksum mismatch {', '.join(self.bad_files[:5])}")
        out.append("PASS" if self.ok else "FAIL")
        return out


def reference_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def hf_reference(hf_dir: str | Path, tokens: torch.Tensor, dtype: torch.dtype) -> dict:
    """Logits and per-layer outputs of the HF model (the independent implementation)."""
    from transformers.utils import logging as hf_logging

    from toolkit.families.hf_values import auto_causal_lm

    AutoModelForCausalLM = auto_causal_lm()  # noqa: N806

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    layer_outputs: list[torch.Tensor] = []
    decoder = getattr(model.model, "language_model", model.model)  # a multimodal wrapper's text model
    hooks = [
        layer.register_forward_hook(lambda m, i, o: layer_outputs.append((o[0] if isinstance(o, tuple) else o).detach()))
        for layer in decoder.layers
    ]
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    for h in hooks:
        h.remove()
    return {"tokens": tokens, "logits": logits, "layers": layer_outputs}


def _stage_forward(model, tokens: torch.Tensor, spec, hidden_dtype) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Forward one pipeline stage, receiving/sending hidden states; returns (logits or None, layer outputs)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    outputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda m, i, o: outputs.append((o[0] if isinstance(o, tuple) else o).detach()))
        for layer in model.decoder.layers
    ]
    device = next(model.parameters()).device
    positions = torch.arange(seq, device=device)[None].expand(batch, -1)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(seq, batch, spec.hidden_size, dtype=hidden_dtype, device=device)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens.to(device), positions, attention_mask=None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            out = None
        else:
            out = gather_from_tensor_model_parallel_region(out.transpose(0, 1).contiguous()).transpose(0, 1)
    for h in hooks:
        h.remove()
    return out, outputs


def worker(jobs: list[dict], tp: int, pp: int, stages: Stages | None = None, ep: int = 1) -> list[dict]:
    """Runs on every rank: load each checkpoint at TP x PP (x EP) and compare with its HF reference."""
    from toolkit.convert.load import load_converted
    from toolkit.model import build_gpt_model
    from toolkit.runtime.distributed import init_parallel, reinit_expert_tp

    info = init_parallel(tp, pp, ep=ep)
    stages = stages or Stages("verify", VERIFY_STAGES, enabled=False)
    results = []
    for job in jobs:
        stages(3, f"loading shards of {job['checkpoint']}", info.rank)
        meta = CheckpointMeta.read(Path(job["checkpoint"]))
        dtype = getattr(torch, job["dtype"])
        spec = meta.model_spec
        if spec.is_moe:  # experts with biases run at expert TP 1 (ModelSpec.expert_tp): their own groups
            info = reinit_expert_tp(info, spec.expert_tp(tp), tp, pp, ep)
        ref = torch.load(job["reference"], weights_only=True)
        model = build_gpt_model(spec, Layout(tp, pp, meta.vocab_divisor, ep if spec.is_moe else 1), dtype).eval()
        load_converted(model, job["checkpoint"], check_sums=False, meta=meta)  # verify_many reports bad sums itself
        if not spec.is_moe and info.dp_rank > 0:
            # A dense model in an EP launch runs data-parallel: every DP replica holds the same weights and gets the
            # same tokens, so replica 0's forward is the whole comparison (its TP/PP collectives stay within it)
            results.append({"layer_diffs": {}})
            del model
            continue
        stages(4, f"forward of {tuple(ref['tokens'].shape)} tokens through {pp} pipeline stage(s)", info.rank)
        logits, outputs = _stage_forward(model, ref["tokens"], spec, dtype)
        first_layer = info.pp_rank * (spec.num_layers // pp)
        result = {
            "layer_diffs": {
                first_layer + i: (o.transpose(0, 1).float().cpu() - ref["layers"][first_layer + i].float()).abs().max().item()
                for i, o in enumerate(outputs)
            }
        }
        if logits is not None and info.tp_rank == 0 and info.dp_rank == 0:  # the other last-stage ranks: the same logits
            logits = logits[..., : spec.vocab_size].float().cpu()
            expected = ref["logits"].float()
            result["top1"] = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
            result["max_logit_diff"] = logits.sub_(expected).abs_().max().item()  # in place: [batch, seq, vocab] is large
        results.append(result)
        del model
    return results


def _checked_inputs(hf_dir: str | Path, megatron_dir: str | Path) -> CheckpointMeta:
    """Both inputs validated as the converters validate them, so bad input is one line here
    rather than a traceback from transformers or from a worker process."""
    from toolkit.convert.hf_config import checked_spec
    from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
    from toolkit.convert.wrapper import open_hf

    src = open_hf(hf_dir)
    checked_spec(src.config, src.dir / "config.json", src.tensors)
    ckpt = MegatronCheckpoint.open(megatron_dir)
    if ckpt.root != Path(megatron_dir):  # a run or step directory, which export takes: verify wants the model itself
        return CheckpointMeta.read(Path(megatron_dir))  # its one line: no toolkit_checkpoint.json there
    return ckpt.meta


def verify_many(
    pairs: list[tuple[str | Path, str | Path]],
    tp: int | None = None,
    pp: int | None = None,
    dtype: str = "float32",
    ep: int | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch: int = DEFAULT_BATCH,
    cpu: bool = False,
    progress: bool | None = None,
) -> list[Report]:
    """Verify several (hf_dir, megatron_dir) pairs in one launch of TP*PP*EP processes (EP ranks
    are data-parallel ranks of the dense part; a dense checkpoint in the batch runs at EP 1).

    TP/PP/EP default to the layout of the first checkpoint; torch_dist checkpoints load at any layout.
    `cpu` runs the processes on CPU where CUDA is present (without it, TP*PP must not exceed the
    GPUs). `progress` prints stage lines on stderr (default: when stderr is a terminal).
    """
    from toolkit.runtime.launch import run_on_processes

    metas = [_checked_inputs(hf_dir, mdir) for hf_dir, mdir in pairs]
    for meta in metas:
        spec = meta.model_spec
        if spec.exact_seq_len is not None and seq_len > spec.exact_seq_len:
            raise VerificationError(f"--seq-len {seq_len} exceeds {spec.exact_seq_len}, the longest sequence {spec.family} "
                                    "converts exactly for (its Llama-4 query scale, 1 up to rope_parameters."
                                    "original_max_position_embeddings, has no megatron-core counterpart)")
    tp = tp or metas[0].tp
    pp = pp or metas[0].pp
    ep = ep or metas[0].ep
    stages = Stages("verify", VERIFY_STAGES, sys.stderr.isatty() if progress is None else progress)
    with tempfile.TemporaryDirectory(prefix="toolkit-verify-") as tmp:
        jobs = []
        for i, ((hf_dir, mdir), meta) in enumerate(zip(pairs, metas)):
            stages(1, f"building the HF reference from {hf_dir} ({dtype}, {batch} x {seq_len} tokens)")
            tokens = reference_tokens(meta.vocab_size, batch, seq_len)
            ref_path = Path(tmp) / f"ref{i}.pt"
            torch.save(hf_reference(hf_dir, tokens, getattr(torch, dtype)), ref_path)
            jobs.append({"checkpoint": str(mdir), "reference": str(ref_path), "dtype": dtype})
        where = "on CPU (--cpu)" if cpu else "on CUDA if present, else CPU"
        stages(2, f"launching {tp * pp * ep} processes (TP {tp} x PP {pp}{f' x EP {ep}' if ep > 1 else ''}) {where}; importing megatron-core")
        per_rank = run_on_processes("toolkit.convert.parity:worker", tp * pp * ep, jobs, tp, pp, stages, ep, cpu=cpu)
    stages(5, "comparing logits and layer outputs; checking shard checksums")
    reports = []
    for j, ((_, mdir), meta) in enumerate(zip(pairs, metas)):
        layer_diffs: dict[int, float] = {}
        logit = next(r[j] for r in per_rank if "max_logit_diff" in r[j])
        for r in per_rank:
            for layer, d in r[j]["layer_diffs"].items():
                layer_diffs[layer] = max(d, layer_diffs.get(layer, 0.0))
        reports.append(
            Report(
                checkpoint=str(mdir),
                dtype=dtype,
                max_logit_diff=logit["max_logit_diff"],
                top1_agreement=logit["top1"],
                layer_diffs=[layer_diffs[i] for i in sorted(layer_diffs)],
                bad_files=bad_checksums(Path(mdir), meta),
            )
        )
    return reports


def verify(hf_dir, megatron_dir, *, dtype: str = "float32", seq_len: int = DEFAULT_SEQ_LEN, batch: int = DEFAULT_BATCH,
           cpu: bool = False, progress: bool | None = None) -> Report:
    if dtype not in TOLERANCE:
        raise VerificationError(f"--dtype must be one of {', '.join(TOLERANCE)}")
    return verify_many([(hf_dir, megatron_dir)], dtype=dtype, seq_len=seq_len, batch=batch, cpu=cpu,
                       progress=progress)[0]
