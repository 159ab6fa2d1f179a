"""The pieces a model is built from: megatron-core modules the toolkit adds or adapts, one module per kind.

A family (toolkit/families/) picks them declaratively (`CustomLayer`, ModelSpec fields); toolkit/model.py
builds the model with them. A new family's new piece goes into the module of its kind, or a new module
named by the same pattern (`attention_<kind>.py`, `mixer_<kind>.py`, `rope_<variant>.py`, ...):

    module                    kind                  holds
    attention_self.py         self-attention        SelfAttention with its layer's own RoPE; Gemma 4's
    attention_sdpa.py         core attention        DotProductAttention through torch's fused SDPA (the local spec's)
    attention_mla.py          core attention        multi-latent attention buildable on the local spec, without TE/CUDA
    attention_dsa.py          core attention        DeepSeek Sparse Attention (megatron-core's DSAttention) on local modules
    context_parallel.py       core attention        the sequence split over CP ranks and the attention across them
    mixer_gated_delta_net.py  token mixer           Qwen3-Next's gated delta net (megatron-core's GatedDeltaNet)
    mixer_mamba.py            token mixer           Nemotron-H's Mamba-2 mixer (megatron-core's MambaMixer)
    norms.py                  norms                 fp32 RMSNorm (1 + w), whole-projection q/k norm, gated, value norm,
                                                    MLA's latent norms at HF's eps
    linears.py                linears               post-normed row-parallel linear, Gemma 4's keys-as-values qkv
    rope_yarn.py              RoPE variant          YaRN without CUDA; a config without YaRN for a layer's own RoPE
    rope_longrope.py          RoPE variant          LongRoPE (Phi-3.5, Phi-4-mini): short/long factors, attention factor
    rope_proportional.py      RoPE variant          Gemma 4's partial rotation with the whole head's frequencies
    rope_mrope.py             RoPE variant          Qwen3-VL's interleaved MRoPE: angles per token from (T, H, W) positions
    moe_layers.py             MoE layer, router     Gemma 4's MoE block beside a dense MLP, its scaled router
    router_losses.py          router loss           the load-balancing loss: megatron-core's, or HF's (layers pooled)
    decoder_spec.py           layer and block       the decoder layer and block specs composing the above per family
    hybrid_spec.py            layer stack           Nemotron-H's hybrid stack (Mamba-2, attention, MLP layers by pattern)
    kernels/                  CPU kernels           plain torch for the GPU kernels megatron-core imports (see there)

No module here imports toolkit/model.py or the trainer; they import these. How tensors are laid out over TP
ranks for conversion is not a block: toolkit/splits/.
"""
