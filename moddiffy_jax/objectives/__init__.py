"""moddiffy_jax.objectives."""
