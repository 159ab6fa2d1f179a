"""wandb.sample_generations: the refusals (in one line, before any process starts) and how a
validation row is cut into prompt and reference. The decoding itself is checked against HF's greedy
`generate` in tests/test_finetune_checkpoint.py (TP = 2, W&B offline)."""

from __future__ import annotations

import pytest

from tests.finetune_harness import assert_refused_in_one_line
from toolkit.train.data import Sample, pack_rows, pad_rows
from toolkit.train.generations import prompts_of

ON = ["wandb.sample_generations=2", "wandb.enabled=true", "data.valid_split=train[:4]"]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2"], r"wandb.sample_generations with parallel.pp=2 is not supported .*set wandb.sample_generations=0"),
    (["wandb.enabled=false"], r"wandb.enabled is false: set wandb.enabled=true"),
    (["data.valid_split=none"], r"needs a validation set: set data.valid_file or data.valid_split"),
])
def test_unsupported_combinations_are_refused_in_one_line(tmp_path, overrides, message):
    assert_refused_in_one_line(tmp_path, ON + overrides, message)


def test_prompt_is_the_first_documents_tokens_before_its_first_target():
    a = Sample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1])  # prompt 1 2 3, response 4 5
    b = Sample([6, 7, 8], [0, 1, 1])
    text = Sample([9, 10], [0, 1])  # a text sample: every token after the first is trained
    for rows in (pad_rows([a, b, text], 8, 0), pack_rows([a, b, text], 11, 0)):
        prompts = prompts_of(rows, 5)
        first = prompts[0]
        assert (first.prompt, first.reference) == ([1, 2, 3], [4, 5]), "never the packed neighbour's tokens"
    padded = prompts_of(pad_rows([a, b, text], 8, 0), 2)
    assert [(p.prompt, p.reference) for p in padded] == [([1, 2, 3], [4, 5]), ([6], [7, 8])]
