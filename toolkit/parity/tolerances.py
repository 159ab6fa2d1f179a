"""The fp32 bars of a megatron-core run that trains like its HF reference (kept free of heavy
imports: `toolkit --help` shows them)."""

# Measured differences of matching runs are ~1e-6 on the loss and ~1e-5 relative on the gradient
# norm at TP2 x PP2 x DP2 (tests/test_finetune_parity.py); a one-setting mistake (RoPE base, loss
# scale, a swapped layer) is orders of magnitude above them (tests/test_parity_command.py).
LOSS_TOLERANCE_FP32 = 1e-5
GRAD_NORM_TOLERANCE = 1e-4  # relative, to max(1, reference)
