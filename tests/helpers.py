"""Helpers shared by test modules."""

import os

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


def cli_env(devices: int) -> dict:
    """This process's environment for a command-line subprocess that sees
    ``devices`` CPU devices."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count", "--ignored_device_count"
    )
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    return env


# The tiny MoDDiffy-par run through the command line (no leakage probes).
TINY_PAR_CLI = [
    "-m",
    "moddiffy_jax.main",
    "--config=configs/tiny.py:moddiffy_par",
    "--config.eval.leakage=False",
]
