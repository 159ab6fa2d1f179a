"""Mistral: the Llama table, plus a sliding attention window on every layer (megatron `window_size`)."""

from toolkit.families.llama import ROWS
from toolkit.families.table import Family

MISTRAL = Family(
    name="mistral",
    model_types=("mistral",),
    architecture="MistralForCausalLM",
    rows=ROWS,
    window_key="sliding_window",
)
