"""Vision-language fine-tuning: `recipes/finetune.py` on a tiny Qwen3-VL (transformers' Qwen3VLConfig and
Qwen3VLForConditionalGeneration with its vision tower, save_pretrained, its processor beside it) and chat JSONL with
images of different sizes (several in one sample, several sizes in one micro-batch) and text-only conversations
(one micro-batch without any image), against tests/vlm_reference.py: transformers' model and processor in one
process with torch's AdamW over the same global batches and the same frozen parts.

One launch of 4 ranks (tests/recipe_vlm_guards.py) at TP2 x PP2: the recipe's 10 fp32 steps, losses within
LOSS_TOLERANCE_FP32 and gradient norms within GRAD_NORM_TOLERANCE (relative) of HF's, then in the same processes one
step of each guard, which must miss HF's first loss by far more than the tolerance: MRoPE positions computed as 1D
(text positions), the image features placed one token late, DeepStack dropped; and two steps with the projector
frozen too (vlm.freeze's default), against HF's with the same frozen parts, and not HF's without.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, REPO, launch, read_metrics, recipe
from tests.vlm_reference import hf_vlm_reference

GUARDS = ("mrope-1d", "image-rows-one-late", "deepstack-dropped")  # tests/recipe_vlm_guards.py's defects
# each guard's first loss at least this many loss tolerances from HF's (measured: 1D positions 122, the rows one
# token late 70, DeepStack dropped 220)
GUARD_MARGIN = 50
# (width, height): tokens after Qwen3-VL's 2 x 2 merge of 16-pixel patches (the tiny processor's resize to 32 px blocks)
IMAGES = {"small.png": (28, 28), "wide.png": (84, 56), "tall.png": (64, 96), "square.png": (96, 96),
          "strip.png": (32, 64)}
FREEZE = ["vision"]  # the projector trains too: its gradient reaches the tower's DeepStack and merger rows


def _user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": f"pics/{p}"} if p.endswith(".png")
                                        else {"type": "text", "text": p} for p in parts]}


def _chat(user, reply: str) -> dict:
    return {"messages": [user if isinstance(user, dict) else {"role": "user", "content": user},
                         {"role": "assistant", "content": reply}]}


def records() -> list[dict]:
    """12 records: 4 global batches of 4 rows (2 micro-batches of 2) cycled over 10 steps; rows 6 and 7 are a
    micro-batch of text alone."""
    return [
        _chat(_user("small.png", "Which is wider?", "wide.png"), "The second."),
        {"messages": [{"role": "user", "content": "<image>Describe it."}, {"role": "assistant", "content": "Tall."}],
         "images": ["pics/tall.png"]},
        _chat("Hi?", "Hello there."),
        _chat(_user("square.png", "Colour?"), "Grey noise."),
        _chat(_user("Two:", "strip.png", "wide.png"), "A strip, then a wide one."),
        _chat(_user("tall.png", "Shape?"), "Tall and thin."),
        _chat("What is 2 + 2?", "4."),
        _chat("Name a colour.", "Blue."),
        _chat(_user("square.png", "small.png", "Bigger?"), "The first."),
        _chat(_user("wide.png", "Orientation?"), "Landscape."),
        _chat("Say yes.", "Yes."),
        _chat(_user("strip.png", "tall.png", "Same height?"), "No, the second is taller."),
    ]


@pytest.fixture(scope="module")
def vlm_data(tmp_path_factory):
    """(the tiny Qwen3-VL with its processor, its converted checkpoint, the JSONL beside its images)."""
    from PIL import Image

    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_qwen3_vl_multimodal, make_tiny_qwen3_vl_processor

    root = tmp_path_factory.mktemp("vlm-finetune")
    hf_dir = make_tiny_qwen3_vl_multimodal(root / "hf", seed=3)
    make_tiny_qwen3_vl_processor(hf_dir)  # the processor beside the weights, as published checkpoints ship it
    checkpoint = hf_to_megatron(hf_dir, root / "megatron", fmt="torch_dist", progress=False)
    (root / "data" / "pics").mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for name, (w, h) in IMAGES.items():
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=generator).numpy()
        Image.fromarray(pixels).save(root / "data" / "pics" / name)
    data = root / "data" / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return hf_dir, checkpoint, data


SEQ_LEN = 112  # the longest sample is 108 tokens: none truncated (the reference reads each whole)
GUARD_SCRIPT = REPO / "tests" / "recipe_vlm_guards.py"


@pytest.mark.multiprocess
def test_tp2_pp2_ten_steps_match_hf_with_images_of_different_sizes_and_each_piece_is_needed(vlm_data, tmp_path):
    hf_dir, checkpoint, data = vlm_data
    cfg_path = recipe(tmp_path, checkpoint, data, data__seq_len=SEQ_LEN, data__valid_file=str(data), global_batch=4,
                      micro_batch=2, save_every=5, vlm={"freeze": FREEZE})
    launch(4, cfg_path, "parallel.tp=2", "parallel.pp=2", script=GUARD_SCRIPT,
           env={"VLM_RUNS": ",".join((*GUARDS, "projector-frozen", "resumed", "tp2-dp2")),
                "GUARD_ROOT": str(tmp_path / "guards")})
    cfg = yaml.safe_load(cfg_path.read_text())
    losses, norms, eval_loss = hf_vlm_reference(hf_dir, data, cfg, cfg["steps"], FREEZE)
    metrics = read_metrics(tmp_path / "run")
    eval_diff = abs(metrics[-1]["eval_loss"] - eval_loss)  # the last step's evaluation over the whole file
    assert [m["step"] for m in metrics] == list(range(1, len(losses) + 1))
    loss_diff = max(abs(m["loss"] - r) for m, r in zip(metrics, losses))
    norm_diff = max(abs(m["grad_norm"] / r - 1) for m, r in zip(metrics, norms))
    guards = {g: read_metrics(tmp_path / "guards" / g / "run")[0] for g in GUARDS}
    moved = {g: abs(m["loss"] - losses[0]) for g, m in guards.items()}
    print(f"TP2 x PP2, 10 steps: max |loss - HF| {loss_diff:.1e}, grad norm relative {norm_diff:.1e}, eval loss "
          f"{eval_diff:.1e}; guards' first "
          "loss off HF's by " + ", ".join(f"{g} {d:.1e}" for g, d in moved.items()) + "; their grad norm by " +
          ", ".join(f"{g} {abs(m['grad_norm'] / norms[0] - 1):.1e}" for g, m in guards.items()))
    assert loss_diff < LOSS_TOLERANCE_FP32, [m["loss"] for m in metrics]
    assert norm_diff < GRAD_NORM_TOLERANCE, [m["grad_norm"] for m in metrics]
    assert eval_diff < LOSS_TOLERANCE_FP32
    for guard, off in moved.items():
        assert off > GUARD_MARGIN * LOSS_TOLERANCE_FP32, guard
    _projector_frozen_matches_hf(hf_dir, data, cfg, tmp_path / "guards" / "projector-frozen" / "run", losses)
    # TP2 x DP2, 3 steps: in the second, one DP rank's micro-batch holds text alone (rows 6 and 7)
    dp2 = read_metrics(tmp_path / "guards" / "tp2-dp2" / "run")
    dp2_loss = max(abs(m["loss"] - r) for m, r in zip(dp2, losses))  # the first 3 steps are the warmup's: same LR
    dp2_norm = max(abs(m["grad_norm"] / r - 1) for m, r in zip(dp2, norms))
    print(f"TP2 x DP2, 3 steps: max |loss - HF| {dp2_loss:.1e}, grad norm relative {dp2_norm:.1e}")
    assert len(dp2) == 3 and dp2_loss < LOSS_TOLERANCE_FP32 and dp2_norm < GRAD_NORM_TOLERANCE
    resumed = read_metrics(tmp_path / "guards" / "resumed" / "run")  # steps 1-5 copied, 6-10 after the resume
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed] == \
        [(m["step"], m["loss"], m["grad_norm"]) for m in metrics]


def _projector_frozen_matches_hf(hf_dir, data, cfg, run_dir, trained_projector_losses) -> None:
    """Two steps with vlm.freeze=vision,projector: HF's with the same parts frozen; the second loss is not the one
    with the projector trained (the first, before any update, is). Its export (RUN_DIR/hf, into the published
    checkpoint) loads as Qwen3VLForConditionalGeneration with the tower as published and HF's trained model's loss."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from tests.vlm_reference import reference_samples, sample_loss_sum

    metrics = read_metrics(run_dir)
    losses, norms, trained_loss = hf_vlm_reference(hf_dir, data, {**cfg, "steps": 2}, 2, ["vision", "projector"])
    loss_diff = max(abs(m["loss"] - r) for m, r in zip(metrics, losses))
    norm_diff = max(abs(m["grad_norm"] / r - 1) for m, r in zip(metrics, norms))
    moved = abs(metrics[1]["loss"] - trained_projector_losses[1])  # both steps in the warmup: the same LR
    exported = Qwen3VLForConditionalGeneration.from_pretrained(str(run_dir / "hf"), dtype=torch.float32).eval()
    published = Qwen3VLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32).model.visual
    with torch.no_grad():
        sums = [sample_loss_sum(exported, s)
                for s in reference_samples(AutoProcessor.from_pretrained(str(run_dir / "hf")), data)]
    export_diff = abs(float(sum(t for t, _ in sums) / sum(n for _, n in sums)) - trained_loss)
    print(f"projector frozen, 2 steps: max |loss - HF| {loss_diff:.1e}, grad norm relative {norm_diff:.1e}; the second "
          f"loss off HF's with the projector trained by {moved:.1e}; the export's loss off HF's trained model's by "
          f"{export_diff:.1e}")
    assert len(metrics) == 2 and loss_diff < LOSS_TOLERANCE_FP32 and norm_diff < GRAD_NORM_TOLERANCE
    assert moved > GUARD_MARGIN * LOSS_TOLERANCE_FP32
    assert export_diff < LOSS_TOLERANCE_FP32
    assert all(torch.equal(a, b) for a, b in zip(exported.model.visual.state_dict().values(),
                                                 published.state_dict().values()))


@pytest.mark.parametrize("overrides, line", [
    (["vlm.freeze=visoin"], r"vlm.freeze='visoin': must be one of vision, projector, language"),
    (["vlm.freeze=vision,projector,language"], "freezes every part: nothing would train"),
    (["vlm.wrapper=/no/such/dir"], r"whose published checkpoint \(config, vision tower, processor\) is not at "
                                   "/no/such/dir: give its directory as vlm.wrapper=DIR"),
    (["data.pack=true"], "a vision-language checkpoint with data.pack=true"),
    (["data.truncation=left"], "a vision-language checkpoint with data.truncation=left or data.overlong=drop"),
    (["parallel.vpp=3", "parallel.pp=2"], "a vision-language checkpoint with parallel.vpp > 1"),
    (["peft.enabled=true"], "a vision-language checkpoint with peft.enabled=true"),
    (["export_hf=true", "vlm.freeze=vision"], "export_hf=true with the tower trained"),
    (["parallel.recompute=full"], "a vision-language checkpoint with parallel.recompute=full"),
    (["parallel.zero_stage=2", "vlm.freeze=vision"], "parallel.zero_stage > 1 with the tower trained"),
    (["parallel.pp=2", "vlm.freeze=vision,language"], "vlm.freeze=language at parallel.pp > 1: the later stages would "
                                                      "hold nothing to train"),
])
def test_bad_vlm_settings_are_one_line_naming_the_fix_before_any_process_starts(vlm_data, tmp_path, monkeypatch,
                                                                                overrides, line):
    from tests.finetune_harness import recipe_prepare
    from toolkit.errors import ToolkitError

    _, checkpoint, data = vlm_data
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg_path = recipe(tmp_path, checkpoint, data, data__seq_len=SEQ_LEN, global_batch=4)
    with pytest.raises(ToolkitError, match=line) as refused:
        recipe_prepare()(str(cfg_path), overrides)
    assert "\n" not in str(refused.value)


def test_the_default_freezes_the_tower_and_projector_and_names_every_part(vlm_data):
    """vlm.freeze's default is LLaMA-Factory's (vision tower and projector frozen); every parameter of the model is
    one of the three parts, by the names HF's own parts (tests/vlm_reference.py's HF_PARTS) have."""
    from tests.vlm_reference import HF_PARTS
    from toolkit.train.config import config_from_mapping
    from toolkit.vlm.freeze import part_of

    hf_dir, checkpoint, data = vlm_data
    assert config_from_mapping({"model": {"checkpoint": str(checkpoint)}, "data": {"train_file": str(data)}}
                               ).vlm.freeze == ["vision", "projector"]
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        visual = [n for n in f.keys() if n.startswith("model.visual.")]
    for name in visual:  # the tower as VisionLanguageModel holds it: vision.model.<HF's name under model.visual>
        ours = part_of("vision.model." + name.removeprefix("model.visual."))
        assert name.startswith(HF_PARTS[ours]), name
    assert part_of("language_model.decoder.layers.0.mlp.linear_fc1.weight") == "language"


def test_toolkit_data_prepare_says_images_are_read_at_each_start(vlm_data, tmp_path):
    from toolkit.errors import ToolkitError
    from toolkit.train.recipe_data import prepare_for_recipe

    _, checkpoint, data = vlm_data
    with pytest.raises(ToolkitError, match="is a vision-language model .qwen3_vl.: the recipe reads its data, images "
                                           "included, in memory at every start; there is nothing to prepare"):
        prepare_for_recipe(str(recipe(tmp_path, checkpoint, data)), [])


def test_text_alone_on_a_vision_language_checkpoint_needs_no_processor(vlm_data, tmp_path, monkeypatch):
    """Text-only data reads as the text path's rows (every token text, no images) and loads no processor: a wrapper
    without the processor's files will do; the image data's rows carry their images."""
    import shutil

    from tests.finetune_harness import recipe_prepare

    hf_dir, checkpoint, data = vlm_data
    bare = tmp_path / "bare-wrapper"
    shutil.copytree(hf_dir, bare, ignore=shutil.ignore_patterns("processor_config.json", "chat_template.jinja"))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in records() if "images" not in r and "pics/" not in json.dumps(r))
                    * 2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    prepare = recipe_prepare()
    rows = prepare(str(recipe(tmp_path, checkpoint, text, data__seq_len=SEQ_LEN, global_batch=4)),
                   [f"vlm.wrapper={bare}"]).data.train
    assert len(rows) == 8 and all(r.pixel_values is None and not any(r.token_types) for r in rows)
    rows = prepare(str(recipe(tmp_path, checkpoint, data, data__seq_len=SEQ_LEN, global_batch=4)), []).data.train
    assert sum(r.pixel_values is not None for r in rows) == 8 and sum(sum(r.token_types) for r in rows) > 0
