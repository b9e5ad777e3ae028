"""moddiffy_jax: modular, on-demand bias mitigation with sparse subnetworks.

Every method is one picture: ``effective = T(base, subnet_state, rng, train)``
where ``base`` is a frozen parameter pytree and ``T`` a pure pytree transform.
See ``moddiffy_jax.subnets`` for the transforms and ``moddiffy_jax.models`` for
the Flax BERT that they apply to.
"""

__version__ = "0.1.0"
