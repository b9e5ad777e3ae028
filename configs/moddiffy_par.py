r"""MoDDiffy-par: core fine-tuned and one sparse debiasing diff per attribute trained in the same loop.

Run (from the repository root)::

    python -m moddiffy_jax.main --config=configs/moddiffy_par.py --workdir=runs/moddiffy_par
    python -m moddiffy_jax.main --config=configs/moddiffy_par.py:data=dwmw17 --workdir=runs/moddiffy_par_dwmw17

Arguments after ":" are comma-separated key=value pairs: data=synthetic|dwmw17
(synthetic is generated in code; dwmw17 reads
../shared/data/dwmw17_dialect by path), model=minilm|tiny,
objective=mmd|adversarial (default mmd). Any field can be overridden with
--config.<field>=<value>; the config is locked, so a misspelled field fails.
Measured (2-core CPU, 2026-11-22; BENCHMARKS.md): the synthetic default takes
about 10 minutes (training 7 min, then the composition matrix with 3 probe
seeds). Test accuracy: core 0.926, core+both diffs 0.920. Age leakage:
0.965 -> 0.941. dwmw17: 17 minutes; test accuracy 0.914 -> 0.906 with the
dialect diff, dialect leakage 0.941 -> 0.935, RMS TPR gap 0.382 -> 0.252.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("moddiffy_par", arg)
