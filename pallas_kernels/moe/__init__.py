"""Routed experts of the latent MoE (docs/model.md §6, MXFP4 §7.2): api (dispatch through the decode policy), the XLA
reference and fallback, the grouped-experts kernels' bodies (sm90.py: Hopper, WGMMA with A from registers;
sm100.py: Blackwell, tcgen05 with TMEM accumulators; bodies.py: what they share), the jnp MXFP4 maths both
decode with."""
