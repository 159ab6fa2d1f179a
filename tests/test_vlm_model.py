"""Qwen3-VL on megatron-core (toolkit/vlm/) against transformers' Qwen3VLForConditionalGeneration on image + text.

The model is the tiny Qwen3-VL wrapper of toolkit.tinymodels (transformers' own config classes: DeepStack after the
first decoder layer, interleaved MRoPE sections [2, 2, 2]), its language model converted to torch_dist; the batch
is the tiny processor's (make_tiny_qwen3_vl_processor) on two conversations with three images of three sizes,
right-padded. HF is the reference: its logits (fp32, within 1e-4 at the unpadded tokens), its loss and the
gradient norm of one backward (within 1e-4 relative, the whole model's and the vision tower's), at TP1, TP2, PP2
and TP2 with sequence parallelism, in one launch of two ranks. Guards, at TP1 in the same launch: MRoPE positions
replaced by text positions, the image embeddings not placed at the image tokens, the image rows placed one token
late, DeepStack skipped: each moves the logits far past 1e-4; the tower's image rows detached move its gradient norm
far past 1e-4 relative. At PP2, DeepStack's refusals (its layers past the first stage, full recompute).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_convert_parity import FP32_TOLERANCE
from toolkit.convert import hf_to_megatron
from toolkit.runtime.launch import run_on_processes
from toolkit.tinymodels import make_tiny_qwen3_vl_multimodal, make_tiny_qwen3_vl_processor
from toolkit.vlm.positions import mrope_position_ids

GRAD_NORM_RTOL = 1e-4
LAYOUTS = ((1, 1, False), (2, 1, False), (1, 2, False), (2, 1, True))  # (TP, PP, sequence parallel), two ranks
GUARDS = ("text positions", "image embeddings not placed", "image rows one token late", "DeepStack skipped")
IMAGE_SIZES = ((28, 28), (84, 56), (64, 96))  # (width, height): 1, 6 and 6 tokens (grids 2x2, 4x6, 6x4)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(wrapper dir, converted checkpoint, processor batch) of the tiny Qwen3-VL."""
    import transformers
    from PIL import Image

    root = tmp_path_factory.mktemp("vlm")
    processor = transformers.AutoProcessor.from_pretrained(str(make_tiny_qwen3_vl_processor(root / "processor")))
    hf_dir = make_tiny_qwen3_vl_multimodal(root / "hf", seed=3)
    checkpoint = hf_to_megatron(hf_dir, root / "megatron", fmt="torch_dist", progress=False)
    generator = torch.Generator().manual_seed(0)
    small, wide, tall = (
        Image.fromarray(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=generator).numpy())
        for w, h in IMAGE_SIZES)
    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": small}, {"type": "text", "text": "Which is wider?"},
                                      {"type": "image", "image": wide}]},
         {"role": "assistant", "content": [{"type": "text", "text": "The second."}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": tall}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Tall."}]}]]
    batch = dict(processor.apply_chat_template(conversations, tokenize=True, return_dict=True, return_tensors="pt",
                                               padding=True))
    return hf_dir, checkpoint, padded_to_even_length(batch, processor.tokenizer.pad_token_id)


def padded_to_even_length(batch: dict, pad_id: int) -> dict:
    """One more padding token where the batch's length is odd: sequence parallelism splits it over TP 2."""
    if batch["input_ids"].shape[1] % 2 == 0:
        return batch
    pads = {"input_ids": pad_id, "attention_mask": 0, "mm_token_type_ids": 0}
    return batch | {k: torch.cat((batch[k], torch.full_like(batch[k][:, :1], v)), dim=1) for k, v in pads.items()}


def _named(tp: int, pp: int, sp: bool) -> str:
    return f"TP{tp} PP{pp}" + (" SP" if sp else "")


def hf_model(hf_dir):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_mrope_positions_are_transformers_get_rope_index(vlm):
    """Our positions equal HF's get_rope_index on the padded batch of three image sizes (at every unpadded token;
    padding is 0 in both); they are not text positions (three distinct streams at the images)."""
    hf_dir, _, batch = vlm
    expected, _ = hf_model(hf_dir).model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"], attention_mask=batch["attention_mask"])
    ours = mrope_position_ids(batch["mm_token_type_ids"], batch["image_grid_thw"], 2, batch["attention_mask"])
    assert torch.equal(ours, expected)
    assert not torch.equal(ours[1], ours[0]) and not torch.equal(ours[2], ours[1])


@pytest.mark.parametrize("section,head_dim", [([2, 2, 2], 12), ([24, 20, 20], 128)])
def test_interleaved_mrope_is_transformers_cos_sin_and_not_megatron_cores_chunked(section, head_dim, monkeypatch):
    """InterleavedMRoPE's angles give HF's Qwen3VLTextRotaryEmbedding cos and sin bit for bit, for the tiny and the
    published sections, on positions whose three streams differ; megatron-core's MultimodalRotaryEmbedding (the
    chunked layout) gives other values from the same positions."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from toolkit.blocks.rope_mrope import InterleavedMRoPE

    positions = torch.stack([torch.arange(40), torch.arange(40) // 3 + 5, torch.arange(40) % 7 + 2])[:, None]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}
    cos, sin = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(head_dim=head_dim, rope_parameters=rope))(
        torch.zeros(1), positions)
    angles = InterleavedMRoPE(head_dim, 1e6, section)(positions)  # [s, b, 1, head_dim]
    assert torch.equal(angles.cos()[:, :, 0].transpose(0, 1), cos) and torch.equal(
        angles.sin()[:, :, 0].transpose(0, 1), sin)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its inv_freq is made there
    chunked = MultimodalRotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=1e6)(positions, section)
    assert (chunked.cos() - angles.cos()).abs().max() > 0.1


def hf_reference(hf_dir, batch) -> dict:
    """HF's logits, loss and gradient norms (the whole model's and its vision tower's) of one backward."""
    model = hf_model(hf_dir)
    out = model(**batch, labels=training_labels(batch))
    out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.item(), "grad_norm": _norm(model.parameters()),
            "vision_grad_norm": _norm(model.model.visual.parameters())}


def _norm(params) -> float:
    return torch.stack([p.grad.double().square().sum() for p in params if p.grad is not None]).sum().sqrt().item()


def training_labels(batch) -> torch.Tensor:
    """Every unpadded token a target (HF shifts them)."""
    return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)


def test_tp1_tp2_pp2_and_sequence_parallel_match_hf_logits_loss_and_grad_norm_and_each_piece_is_needed(vlm):
    hf_dir, checkpoint, batch = vlm
    ref = hf_reference(hf_dir, batch)
    per_rank = run_on_processes("tests.test_vlm_model:layouts_worker", 2, str(hf_dir), str(checkpoint), batch)
    valid = batch["attention_mask"].bool()
    figures = {}  # printed for the record (pytest -s)
    for (tp, pp, sp), result in zip(LAYOUTS, per_rank[-1]["layouts"]):  # the last rank: last stage of every layout
        where = _named(tp, pp, sp)
        assert result["sequence_parallel"] == sp, where
        dlogit = (torch.tensor(result["logits"]) - ref["logits"])[valid].abs().max().item()
        figures[where] = {"max |dlogit|": dlogit, "dloss": abs(result["loss"] - ref["loss"]),
                          "grad norm rel": abs(result["grad_norm"] / ref["grad_norm"] - 1)}
        assert dlogit < FP32_TOLERANCE, where
        assert result["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=0), where
        assert result["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_RTOL), where
    for (tp, pp, sp), result in zip(LAYOUTS, per_rank[0]["layouts"]):  # rank 0: the first stage, holding the tower
        figures[_named(tp, pp, sp)]["vision grad norm rel"] = abs(
            result["vision_grad_norm"] / ref["vision_grad_norm"] - 1)
        assert result["vision_grad_norm"] == pytest.approx(ref["vision_grad_norm"], rel=GRAD_NORM_RTOL), (tp, pp, sp)
    for tp2 in (LAYOUTS.index((2, 1, False)), LAYOUTS.index((2, 1, True))):  # the tower replicated: the same gradient
        ranks = [per_rank[r]["layouts"][tp2]["local_vision_grad_norm"] for r in (0, 1)]
        assert ranks[0] == ranks[1], LAYOUTS[tp2]
    detached = abs(per_rank[0]["detached vision grad norm"] / ref["vision_grad_norm"] - 1)
    figures["image rows detached: vision grad norm rel"] = detached
    assert detached > 100 * GRAD_NORM_RTOL
    stage0, stage1 = per_rank[0]["refusals"], per_rank[1]["refusals"]
    refused = ("DeepStack adds visual features after the first 4 decoder layers, which must all be on the first "
               "pipeline stage (the vision tower's): use fewer pipeline stages")
    assert stage0[0] == refused and stage1[0] == refused  # stage 0 holds layers 0-2, stage 1 layer 3
    assert stage0[1].startswith("DeepStack with full activation recompute: not yet") and stage1[1] == ""
    for guard in GUARDS:
        moved = (torch.tensor(per_rank[0]["guards"][guard]) - ref["logits"])[valid].abs().max().item()
        figures[guard] = moved
        assert moved > 100 * FP32_TOLERANCE, guard
    print(figures)


def layouts_worker(hf_dir: str, checkpoint: str, batch: dict) -> dict:
    """On each of two ranks: per layout of LAYOUTS, the model's logits, loss and gradient norms of one backward;
    at TP1, each guard's logits; at PP2, DeepStack's refusals."""
    from tests.workers_memory import switch_layout
    from toolkit.train.parallel import sum_partial_grads_over_tp
    from toolkit.vlm.model import build_vision_language_model

    out = {"layouts": []}
    for tp, pp, sp in LAYOUTS:
        device = switch_layout(tp, pp).device
        batch = {k: v.to(device) for k, v in batch.items()}
        model = build_vision_language_model(hf_dir, checkpoint, tp, pp, sequence_parallel=sp)
        sum_partial_grads_over_tp(model)  # as the trainer does: q/k norms see their rank's heads only
        out["layouts"].append(_forward_backward(model, batch) | {"sequence_parallel": model.config.sequence_parallel})
        if (tp, pp, sp) == (1, 1, False):
            out["detached vision grad norm"] = _detached_tower_grad_norm(model, batch)
            out["guards"] = _guard_logits(model, batch)
        if (tp, pp, sp) == (1, 2, False):
            out["refusals"] = _deepstack_refusals(model.language_model)
    return out


def _detached_tower_grad_norm(model, batch: dict) -> float:
    """The backward's guard: the tower's gradient norm with its image rows detached (its DeepStack rows' alone)."""
    from unittest import mock

    from toolkit.vlm import model as composed

    place = composed.place_image_embeds
    model.zero_grad(set_to_none=True)
    detached = lambda embeds, mask, rows, sp: place(embeds, mask, rows.detach(), sp)  # noqa: E731
    with mock.patch.object(composed, "place_image_embeds", detached):
        return _forward_backward(model, batch)["vision_grad_norm"]


def _deepstack_refusals(gpt) -> list[str]:
    """What DeepStack says on this stage for more DeepStack layers than the first stage holds (3 of 6 at PP2), and
    under full activation recompute."""
    from toolkit.errors import ConfigError
    from toolkit.vlm.deepstack import DeepStack

    lines = []
    for layers, recompute in ((4, None), (1, "full")):
        gpt.config.recompute_granularity = recompute
        try:
            DeepStack(gpt, layers, gpt.pre_process)
            lines.append("")
        except ConfigError as e:
            lines.append(str(e))
    gpt.config.recompute_granularity = None
    return lines


def _model_inputs(batch: dict) -> dict:
    return {"input_ids": batch["input_ids"], "token_types": batch["mm_token_type_ids"],
            "pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}


def _forward_backward(model, batch: dict) -> dict:
    """One forward and backward through megatron-core's pipeline schedule (one micro-batch), the loss HF's mean
    over the shifted targets; the gradient norms summed over the model-parallel ranks, TP duplicates once."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from toolkit.train.loss import padded_vocab_mask, token_losses

    labels = training_labels(batch)  # each token's target: the next one's label, none at the end
    shifted = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], -100)), dim=1)
    targets, mask = shifted.clamp(min=0), (shifted != -100).float()

    def loss_func(logits):
        vocab_mask = padded_vocab_mask(model.vocab_size, model.language_model.vocab_size,
                                       ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                                       logits.device)
        # before the loss: megatron-core's vocab-parallel cross-entropy shifts its input logits in place
        whole = gather_from_tensor_model_parallel_region(logits.detach())[..., : model.vocab_size].cpu().tolist()
        loss = (token_losses(logits, targets, vocab_mask) * mask).sum() / mask.sum()
        return loss, {"loss": loss.item(), "logits": whole}

    outputs = get_forward_backward_func()(
        forward_step_func=lambda data, chunk: (chunk(**_model_inputs(next(data))), loss_func),
        data_iterator=iter([batch]), model=model, num_microbatches=1, seq_length=labels.shape[1],
        micro_batch_size=labels.shape[0], forward_only=False)
    result = dict(outputs[0]) if outputs else {}  # the last stage's
    result["grad_norm"] = _model_parallel_norm(model.parameters())
    if model.vision is not None:
        result["vision_grad_norm"] = _model_parallel_norm(model.vision.parameters(), across_pipeline=False)
        result["local_vision_grad_norm"] = _norm(model.vision.parameters())
    return result


def _model_parallel_norm(params, across_pipeline: bool = True) -> float:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = list(params)
    squares = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            squares += p.grad.double().square().sum()
    dist.all_reduce(squares, group=ps.get_model_parallel_group() if across_pipeline
                    else ps.get_tensor_model_parallel_group())
    return squares.sqrt().item()


def _guard_logits(model, batch: dict) -> dict:
    """The logits with each piece broken (TP1 PP1, whole vocab as the model's output)."""
    from unittest import mock

    inputs = _model_inputs(batch)
    ids = batch["input_ids"]
    text = torch.arange(ids.shape[1], device=ids.device).expand(3, *ids.shape)
    out = {}
    with torch.no_grad():
        out[GUARDS[0]] = model(**inputs, position_ids=text)
        with mock.patch("toolkit.vlm.model.place_image_embeds", lambda embeds, mask, rows, sp: embeds):
            out[GUARDS[1]] = model(**inputs)
        with mock.patch("toolkit.vlm.model.image_token_mask", lambda ids, image_token: (ids == image_token).roll(1, 1)):
            out[GUARDS[2]] = model(**inputs)  # the tower's and DeepStack's rows each placed one token late
        for hook in model.deepstack.hooks:
            hook.remove()
        out[GUARDS[3]] = model(**inputs)
    return {k: v[..., : model.vocab_size].cpu().tolist() for k, v in out.items()}


def test_bad_input_is_refused_in_one_line_naming_the_fix(vlm, tmp_path):
    """Image tokens that the grids do not give (an image cut short), image rows that the tokens do not take, and a
    wrapper whose vision tower is carried but not run (Gemma 3): each one line, before any model is built."""
    from toolkit.errors import ConfigError, ConversionError
    from toolkit.tinymodels import make_tiny_gemma3_multimodal
    from toolkit.train.data_sources import DataError
    from toolkit.vlm.image_tokens import rows_at_image_tokens
    from toolkit.vlm.model import build_vision_language_model
    from toolkit.vlm.vision_tower import load_vision_tower

    hf_dir, checkpoint, batch = vlm
    types = batch["mm_token_type_ids"].clone()
    types[0, types[0].nonzero()[-1]] = 0  # the second image's last token taken for text
    refusals = [(DataError, r"a run of 5 image tokens where image_grid_thw gives \[1, 4, 6\] \(6 tokens\): pass the "
                 "processor's", lambda: mrope_position_ids(types, batch["image_grid_thw"], 2))]
    mask = batch["input_ids"] == 104
    refusals.append((DataError, "13 image tokens in input_ids but 12 image features",
                     lambda: rows_at_image_tokens(mask, torch.zeros(12, 4), torch.float32)))
    gemma3 = make_tiny_gemma3_multimodal(tmp_path / "gemma3")
    refusals.append((ConversionError, "the vision tower of a gemma3 checkpoint is carried, not run",
                     lambda: load_vision_tower(gemma3)))
    refusals.append((ConfigError, r"images run through Qwen3-VL \(qwen3_vl\) only so far",
                     lambda: build_vision_language_model(gemma3, checkpoint)))
    for error, line, call in refusals:
        with pytest.raises(error, match=line) as refused:
            call()
        assert "\n" not in str(refused.value)
