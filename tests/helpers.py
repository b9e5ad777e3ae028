"""Helpers shared by test modules."""

from moddiffy_jax.config_lib import experiment_config


def tiny(method, arg="", **overrides):
    """The tiny config of ``method`` (``arg``: more ``key=value`` arguments;
    ``overrides``: dotted config fields, e.g. ``**{"method.core_run": d}``)."""
    config = experiment_config(method, ",".join(filter(None, ["model=tiny", arg])))
    with config.unlocked():
        for key, value in overrides.items():
            node = config
            *parents, last = key.split(".")
            for p in parents:
                node = node[p]
            node[last] = value
    return config
