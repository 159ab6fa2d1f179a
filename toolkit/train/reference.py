"""method=dpo's reference model: its log-probabilities of every row, computed once per batch.

Full fine-tune: a frozen copy of the starting weights, built and loaded like the policy (same TP/PP
shards, no optimizer, never given to DeepSpeed). LoRA: the policy itself with its adapter disabled
(or, from peft.init_from, with the adapter it started from): no second copy of the base.

The reference pass is a forward-only run of megatron-core's pipeline schedule over the same
micro-batches, just before the training pass; its last stage leaves each row's log-probability on
the batch (`ref_logps`), where the training pass's loss reads it (toolkit.train.preference_loss).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from toolkit.train.preference_loss import reference_logps
from toolkit.train.step import schedule_outputs


class Reference:
    def __init__(self, module, lora: bool):
        self.module, self.lora = module, lora
        if not lora:
            for param in module.parameters():
                param.requires_grad_(False)
            module.eval()

    @classmethod
    def build(cls, policy, meta, cfg, lora: bool) -> "Reference":
        from toolkit.train import build

        if lora:
            return cls(policy, lora=True)
        model, _ = build.build_model(meta, cfg)  # the starting weights, sharded like the policy
        return cls(model, lora=False)

    def _mode(self):
        if not self.lora:
            return contextlib.nullcontext()
        from toolkit.lora.layers import as_reference

        return as_reference(self.module)

    def attach(self, batches: list[dict], ctx) -> None:
        """Each batch's `ref_logps` (on the last pipeline stage)."""
        ref_ctx = dataclasses.replace(ctx, objective=reference_logps)
        training = self.module.training
        self.module.eval()
        with torch.no_grad(), self._mode():
            schedule_outputs(self.module, self.module, batches, ref_ctx, forward_only=True)
        self.module.train(training)
