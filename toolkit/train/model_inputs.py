"""What a micro-batch becomes on the way to the model: the arguments of the model's forward, chosen once before
the loop (toolkit.train.build.model_inputs) and called by the pipeline schedule's forward step for each micro-batch.

    text_inputs         GPTModel(tokens, positions, attention mask[, padding_mask])
    image_text_inputs   VisionLanguageModel(tokens, token types, pixel values, image grids): the images of the
                        micro-batch (toolkit.train.image_rows), run by the tower on the first pipeline stage; every
                        stage takes the token types and grids, from which it computes the MRoPE positions
"""

from __future__ import annotations

import torch


def text_inputs(batch: dict, device, ctx) -> tuple[tuple, dict]:
    tokens = batch["tokens"].to(device)
    # global positions of this CP rank's chunks (toolkit.blocks.context_parallel), else 0..s-1; megatron-core's
    # RoPE takes the same chunks' positions itself, these reach only absolute position embeddings
    positions = batch["positions"].to(device) if "positions" in batch else \
        torch.arange(tokens.shape[1], device=device)[None].expand(tokens.shape[0], -1)
    mask = batch.get("attention_mask")
    extra = {"padding_mask": routing_padding_mask(batch["padding"].to(device), ctx)} if ctx.moe else {}
    return (tokens, positions, None if mask is None else mask.to(device)), extra


def routing_padding_mask(padding: torch.Tensor, ctx) -> torch.Tensor:
    """[b, s], True at padding: megatron-core then leaves those tokens out of the load-balancing
    loss (router.py:598-611), as HF does with an attention mask. Under sequence parallelism GPTModel
    scatters it over TP on the first stage only (gpt_model.py:352-359); later stages get their slice here, and every
    stage of a hybrid model (StepContext.hybrid)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    if ctx.sequence_parallel and (ctx.hybrid or not ps.is_pipeline_first_stage()):
        return scatter_to_sequence_parallel_region(padding.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
    return padding


def image_text_inputs(batch: dict, device, ctx) -> tuple[tuple, dict]:
    images = [batch[k].to(device) if k in batch else None for k in ("pixel_values", "image_grid_thw")]
    return (batch["tokens"].to(device), batch["token_types"].to(device), *images), {}
