r"""MoDDiffy-par: core fine-tuned and one sparse debiasing diff per attribute trained in the same loop.

Run (from the repository root)::

    python -m moddiffy_jax.main --config=configs/moddiffy_par.py --workdir=runs/moddiffy_par
    python -m moddiffy_jax.main --config=configs/moddiffy_par.py:data=dwmw17 --workdir=runs/moddiffy_par_dwmw17

Arguments after ":" are comma-separated key=value pairs: data=synthetic|dwmw17
(synthetic is generated in code; dwmw17 reads
../shared/data/dwmw17_dialect by path), model=minilm|tiny,
objective=mmd|adversarial (default mmd). Any field can be overridden with
--config.<field>=<value>; the config is locked, so a misspelled field fails.
Measured (2-core CPU, 2026-11-23, default recipe: unbiased task-conditional
MMD, gradual pruning; BENCHMARKS.md, docs/efficacy.md), synthetic (10 min
from a fresh clone, training and evaluation 566 s): test
accuracy core 0.926, core+gender 0.908, core+age 0.916; gender leakage
(paper's attacker) 0.981 -> 0.927 (floor 0.912), age 0.966 -> 0.761 (floor
0.744); a linear probe reads more (gender 0.970 -> 0.958, age 0.962 ->
0.924). dwmw17 (25 min with evaluation, while another job shared the
cores): test accuracy 0.916 -> 0.912, dialect leakage 0.940 -> 0.870
(linear 0.962 -> 0.920), RMS TPR gap 0.364 -> 0.143.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("moddiffy_par", arg)
