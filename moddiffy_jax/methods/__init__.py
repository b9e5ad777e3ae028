"""moddiffy_jax.methods."""
