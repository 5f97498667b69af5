"""Decode-batch projections y = x @ wᵀ for out-major ([out, in]) bf16 weights: a streaming Mosaic GPU GEMV with
fp32 accumulation (api.py), its XLA reference and fallback (reference.py)."""
