"""Mixtral: Mistral's attention (a sliding window where set) with routed experts in place of the
MLP; softmax over every expert, top-k, the k probabilities renormalised (HF MixtralTopKRouter),
which is megatron-core's softmax router without pre-softmax (toolkit/families/router.py)."""

from toolkit.families.experts import ATTENTION_ROWS, expert_rows
from toolkit.families.llama import L
from toolkit.families.router import Router
from toolkit.families.table import Family

E = L + "block_sparse_moe."

MIXTRAL = Family(
    name="mixtral",
    model_types=("mixtral",),
    architecture="MixtralForCausalLM",
    rows=ATTENTION_ROWS
    + expert_rows(E + "gate.weight", E + "experts.#.w1.weight", E + "experts.#.w3.weight", E + "experts.#.w2.weight"),
    window_key="sliding_window",
    router=Router(
        experts_keys=("num_local_experts",),
        ffn_key="intermediate_size",
        exact={"router_jitter_noise": (0.0, "HF scales the experts' input by the noise too, megatron-core's "
                                            "moe_input_jitter_eps only the router's (transformer/moe/router.py:510)")},
    ),
)
