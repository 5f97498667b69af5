"""MLA decode attention over the latent cache (docs/model.md §5.3) and the new rows written into it: api, XLA
reference, Hopper (sm90) and Blackwell (sm100) kernels."""

from pallas_kernels.mla_decode.api import combine, mla_decode_attention, mla_write_rows

__all__ = ["combine", "mla_decode_attention", "mla_write_rows"]
