r"""Finetune: all encoder params and the task head on the task loss.

Run (from the repository root)::

    python -m moddiffy_jax.main --config=configs/finetune.py --workdir=runs/finetune
    python -m moddiffy_jax.main --config=configs/finetune.py:data=dwmw17 --workdir=runs/finetune_dwmw17

Arguments after ":" are comma-separated key=value pairs: data=synthetic|dwmw17
(synthetic is generated in code; dwmw17 reads
../shared/data/dwmw17_dialect by path), model=minilm|tiny,
objective=mmd|adversarial (default mmd). Any field can be overridden with
--config.<field>=<value>; the config is locked, so a misspelled field fails.
Measured (2-core CPU, 2026-11-22; BENCHMARKS.md): dwmw17 takes 9 minutes
(466 steps, then probes); test accuracy 0.914, dialect leakage 0.943.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("finetune", arg)
