r"""MoDDiffy-par: core fine-tuned and one sparse debiasing diff per attribute trained in the same loop.

Run (from the repository root)::

    python -m moddiffy_jax.main --config=configs/moddiffy_par.py --workdir=runs/moddiffy_par
    python -m moddiffy_jax.main --config=configs/moddiffy_par.py:data=dwmw17 --workdir=runs/moddiffy_par_dwmw17

Arguments after ":" are comma-separated key=value pairs: data=synthetic|dwmw17
(synthetic is generated in code; dwmw17 reads
../shared/data/dwmw17_dialect by path), model=minilm|tiny,
objective=mmd|adversarial (default mmd). Any field can be overridden with
--config.<field>=<value>; the config is locked, so a misspelled field fails.
Measured (2-core CPU, 2026-11-23, default recipe: whitened linear + Gaussian
task-conditional MMD, gradual pruning; BENCHMARKS.md, docs/efficacy.md),
synthetic, 3 training seeds: test accuracy core 0.932 ± 0.003, core+gender
0.913 ± 0.001, core+age 0.893 ± 0.017; gender leakage (paper's attacker)
0.978 -> 0.879 (floor 0.912), age 0.963 -> 0.718 (floor 0.744); 10 min on
an idle machine (seed 0). dwmw17, seed 0: test accuracy 0.915 -> 0.888,
dialect leakage 0.939 -> 0.794 (the floor; linear 0.963 -> 0.843), RMS TPR
gap 0.353 -> 0.143.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("moddiffy_par", arg)
