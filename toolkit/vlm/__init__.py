"""Vision-language models on megatron-core: the converted language model with transformers' vision tower, one
module per piece (model.py composes them; the MRoPE rotary module is a block, toolkit/blocks/rope_mrope.py):

    module            holds
    positions.py      the 3-D (T, H, W) MRoPE positions of each token from the images' patch grids
    vision_tower.py   transformers' vision tower loaded from the wrapper checkpoint, run on the first stage
    image_tokens.py   the image tokens' mask, and rows placed at them in transformers' order
    deepstack.py      Qwen3-VL's DeepStack: visual rows added after the first decoder layers
    freeze.py         vlm.freeze: the vision, projector and language parts, by parameter name
    model.py          VisionLanguageModel: the pieces in one forward, and its builder

Qwen3-VL (dense) so far; recipes/finetune.py builds it for a Qwen3-VL checkpoint (toolkit.train.build), freezes
vlm.freeze's parts (freeze.py) and trains it on images (docs/guide/vlm.md).
"""
