"""The rows every Mixture-of-Experts family shares: attention as Llama's, then a router and routed
experts in place of the dense MLP. A family file names only its HF tensors.

megatron-core names (SequentialMLP, local numbering on an expert-parallel rank):
    decoder.layers.*.mlp.router.weight                                [experts, hidden], replicated
    decoder.layers.*.mlp.experts.local_experts.#.linear_fc1.weight    [gate; up] per TP rank, as dense
    decoder.layers.*.mlp.experts.local_experts.#.linear_fc2.weight    split on dim 1, as dense
Expert tensor parallelism is megatron-core's default, the TP size (parallel_state.py:786-812).
A shared expert (SharedExpertMLP) is a dense MLP split over TP as a dense one, its gate replicated:
    decoder.layers.*.mlp.shared_experts.linear_fc1.weight / linear_fc2.weight / gate_weight [1, hidden]
"""

from dataclasses import replace

from toolkit.families.llama import ROWS, L, M
from toolkit.families.table import DENSE_LAYER, EXPERT, MOE_LAYER, Row, row
from toolkit.splits import Split

DENSE_MLP = (M + "mlp.linear_fc1.weight", M + "mlp.linear_fc2.weight")
ATTENTION_ROWS = tuple(r for r in ROWS if r.megatron not in DENSE_MLP)
# Llama's MLP rows on the dense layers of a model that mixes them with MoE layers (Qwen2-MoE /
# Qwen3-MoE mlp_only_layers: the same HF names, width intermediate_size)
DENSE_LAYER_ROWS = tuple(replace(r, kind=DENSE_LAYER) for r in ROWS if r.megatron in DENSE_MLP)
LOCAL_EXPERT = M + f"mlp.experts.local_experts.{EXPERT}."
SHARED_EXPERT = M + "mlp.shared_experts."


def expert_rows(router: str, gate: str, up: str, down: str) -> tuple[Row, ...]:
    """Rows of the router and of one expert's gate, up and down projections (HF names with `*`
    for the layer and `#` for the expert)."""
    return (
        row(M + "mlp.router.weight", router, Split.REPLICATED, ("experts", "hidden"), kind=MOE_LAYER),
        row(LOCAL_EXPERT + "linear_fc1.weight", (gate, up), Split.GATE_UP, ("moe_ffn", "hidden"), ("moe_ffn", "hidden"),
            kind=MOE_LAYER),
        row(LOCAL_EXPERT + "linear_fc2.weight", down, Split.ROW, ("hidden", "moe_ffn"), kind=MOE_LAYER),
    )


def shared_expert_rows(gate: str, up: str, down: str, gate_weight: str | None = None) -> tuple[Row, ...]:
    """Rows of the shared expert's gate, up and down projections, and of its sigmoid gate if any."""
    rows = (
        row(SHARED_EXPERT + "linear_fc1.weight", (gate, up), Split.GATE_UP, ("shared_ffn", "hidden"),
            ("shared_ffn", "hidden"), kind=MOE_LAYER),
        row(SHARED_EXPERT + "linear_fc2.weight", down, Split.ROW, ("hidden", "shared_ffn"), kind=MOE_LAYER),
    )
    return rows + ((row(SHARED_EXPERT + "gate_weight", gate_weight, Split.REPLICATED, ("one", "hidden"), kind=MOE_LAYER),)
                   if gate_weight else ())


def _mlp(name: str) -> str:
    return L + "mlp." + name


# Qwen2-MoE, Qwen3-MoE and OLMoE name their router and experts alike
GATE_PROJ_EXPERT_ROWS = expert_rows(_mlp("gate.weight"), _mlp("experts.#.gate_proj.weight"),
                                    _mlp("experts.#.up_proj.weight"), _mlp("experts.#.down_proj.weight"))
