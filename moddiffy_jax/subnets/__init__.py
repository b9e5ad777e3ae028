"""moddiffy_jax.subnets."""
