r"""SRNets iterative magnitude pruning (IMP), with or without rewinding.

Round k of R prunes every selected matrix to the cumulative sparsity
s * (k + 1) / R by smallest |w| among its remaining weights, then trains
num_steps / R steps with a fresh optimizer. Paradigm 1 (prune a fine-tuned
model, no rewinding) starts from a finetune run; paradigm 2 (lottery ticket:
prune the pretrained model, rewinding the encoder to its pretrained weights
after every prune; the classifier is never rewound) starts from the
pretrained encoder::

    # paradigm 2: find the mask with PoE on dwmw17, then retrain it in isolation
    python -m moddiffy_jax.main --config=configs/srnets_imp.py:data=dwmw17,loss=poe,sparsity=0.5 \
        --config.srnets.rewind=True --workdir=runs/srnets_lt_dwmw17
    python -m moddiffy_jax.main --config=configs/srnets_retrain.py:data=dwmw17,loss=poe \
        --config.srnets.mask_run=runs/srnets_lt_dwmw17 --workdir=runs/srnets_lt_retrain_dwmw17
    # paradigm 1: IMP on a fine-tuned model
    python -m moddiffy_jax.main --config=configs/srnets_imp.py:data=dwmw17,sparsity=0.5 \
        --config.method.core_run=runs/finetune_dwmw17 --workdir=runs/srnets_imp_dwmw17

Arguments after ":" as in configs/srnets_mask.py. The trained subnetwork is
exported as the core; its mask (relative to the start weights) as
export/mask.safetensors. Measured (2-core CPU, 2026-11-24, BENCHMARKS.md
"IMP with and without rewinding"; PoE, 50%, best-dev selection): paradigm 1
keeps test accuracy 0.906 (dense 0.914) with bias-conflicting accuracy
0.595 (dense 0.571); the rewound mask retrained in isolation reaches 0.891,
conflicting 0.595, RMS TPR gap 0.116 (dense 0.379).
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("srnets_imp", arg)
