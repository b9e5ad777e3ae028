r"""FFW ("debiasing surgeon", Nahon et al. 2024): cut the weights that carry bias.

Gates on every weight of a frozen, vanilla-trained model are trained to keep
the task (cross-entropy) while minimising the mutual information between the
bias label and a bias extractor's prediction; the final pruning keeps a
weight iff its gate logit is >= 0, without retraining. Start from a finished
run of this library (``--config.method.core_run``)::

    # Biased MNIST (rho 0.97; 6,797 real digits, synthetic colours), the MLP
    python -m moddiffy_jax.main --config=configs/finetune.py:data=bmnist --workdir=runs/vanilla_bmnist \
        --config.model.vision.arch=mlp --config.data.vision.rho=0.97 --config.train.num_steps=4240
    python -m moddiffy_jax.main --config=configs/ffw.py:data=bmnist --config.model.vision.arch=mlp \
        --config.data.vision.rho=0.97 --config.method.core_run=runs/vanilla_bmnist --workdir=runs/ffw_bmnist
    # The same surgery on the MiniLM MoDDiffy core for the dialect attribute
    python -m moddiffy_jax.main --config=configs/ffw.py:data=dwmw17 \
        --config.method.core_run=runs/moddiffy_par_dwmw17 --workdir=runs/ffw_dwmw17
    python -m moddiffy_jax.evaluate --workdir=runs/ffw_dwmw17   # core, +dialect diff, +ffw

Arguments after ":": data=bmnist|mcmnist|dwmw17|synthetic, model=minilm|tiny.
On images the CPU config anneals the temperature geometrically (1 -> 1e-3 in
60 gate epochs, then 5 more) with gamma = 1, so the hard pruning equals the
soft-gated net; the reference's plateau controller and gamma = 10 are
``--config.ffw.tau_schedule=plateau --config.ffw.gamma=10`` (see
docs/differences.md for why they are not the CPU default). On text the CPU
config anneals 1 -> 1e-3 in 10 gate epochs (2 more at 1e-3) on 2,000
training tweets with gamma = 0.3 and the gates started open
(init_logit = 0.05): on the dwmw17 finetune core it kept test accuracy
within 0.6 points and lowered dialect leakage from 0.948 / 0.956 to 0.800 /
0.854 (attacker / linear; stop 19, one seed).
Structured (per output channel) gates: --config.ffw.structured=True. The
text run copies the core run's diffs into its export so ``evaluate`` puts the
MoDDiffy diffs and the FFW pruning in one composition/leakage table.
results.json holds task, unbiased and bias-conflicting accuracy before and
after, the pruned fraction per layer and the temperature history.
Measured (2-core CPU; BENCHMARKS.md): see the FFW sections (stop 18 for the
image schedule, stop 19 for text).
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("ffw", arg)
