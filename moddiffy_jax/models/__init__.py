"""moddiffy_jax.models."""
