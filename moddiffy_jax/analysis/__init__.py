"""moddiffy_jax.analysis."""
