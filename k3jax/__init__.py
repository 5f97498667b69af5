from k3jax.checkpoint import load  # noqa: F401  (k3jax.load)
