"""LoRA on megatron-core's tensor-parallel linears, read from and written as HF PEFT adapters.

    targets.py   which linears a family has, in PEFT's names (read from the family table)
    shards.py    which rows/columns of a PEFT tensor one TP rank holds (from toolkit.splits)
    layers.py    the column- and row-parallel LoRA wrappers
    adapter.py   settings, PEFT-style initialisation, applying LoRA to a model, gathering it back
    peft_dir.py  the HF PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
    experts.py   the routed experts, as PEFT's target_parameters on transformers 5's fused weights
    peft_rewrites.py  the linears PEFT would rewrite onto the experts, kept as `<name>.weight` parameters
"""
