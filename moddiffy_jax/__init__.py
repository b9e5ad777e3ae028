"""moddiffy_jax: modular, on-demand bias mitigation with sparse subnetworks.

Every method is one picture: ``effective = T(base, subnet_state, rng, train)``
where ``base`` is a frozen parameter pytree and ``T`` a pure pytree transform.
See ``moddiffy_jax.subnets`` for the transforms and ``moddiffy_jax.models`` for
the Flax BERT that they apply to.
"""

__version__ = "0.1.0"

# Before any JAX computation: XLA's per-step temporary arena reuses its pages
# instead of faulting them in again every step (moddiffy_jax/hostmem.py;
# MODDIFFY_JAX_KEEP_FREED_MEMORY=0 turns it off).
from moddiffy_jax import hostmem as _hostmem  # noqa: E402

if _hostmem.enabled_by_env():
    _hostmem.keep_freed_memory()
