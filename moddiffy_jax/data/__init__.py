"""moddiffy_jax.data."""
