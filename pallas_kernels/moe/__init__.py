"""Routed experts of the latent MoE (docs/model.md §6, MXFP4 §7.2): api (dispatch through the decode policy), the XLA
reference and fallback, the Hopper (sm90) grouped-experts kernels, the jnp MXFP4 maths both decode with."""
