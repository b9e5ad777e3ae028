"""moddiffy_jax.eval."""
