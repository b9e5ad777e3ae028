r"""DiffPrun-debias: DiffPrun with the removal terms of every attribute.

Run (from the repository root)::

    python -m moddiffy_jax.main --config=configs/diffprun_debias.py --workdir=runs/diffprun_debias
    python -m moddiffy_jax.main --config=configs/diffprun_debias.py:data=dwmw17 --workdir=runs/diffprun_debias_dwmw17

Arguments after ":" are comma-separated key=value pairs: data=synthetic|dwmw17
(synthetic is generated in code; dwmw17 reads
../shared/data/dwmw17_dialect by path), model=minilm|tiny,
objective=mmd|adversarial (default mmd). Any field can be overridden with
--config.<field>=<value>; the config is locked, so a misspelled field fails.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("diffprun_debias", arg)
