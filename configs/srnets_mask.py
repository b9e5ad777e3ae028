r"""SRNets mask training (Liu et al. 2022): a sparse subnetwork found by scores.

Only the scores train (straight-through, magnitude init, per-matrix exact
sparsity reset every 50 steps); every weight stays frozen. Paradigm 1 (prune
a fine-tuned model) starts from a finished finetune run; paradigm 3 (no
fine-tuning at all) starts from the pretrained encoder with a random frozen
classifier::

    # paradigm 1, PoE with the dialect bias model, 70% sparsity
    python -m moddiffy_jax.main --config=configs/finetune.py:data=dwmw17 --workdir=runs/finetune_dwmw17
    python -m moddiffy_jax.main --config=configs/srnets_mask.py:data=dwmw17,loss=poe,sparsity=0.7 \
        --config.method.core_run=runs/finetune_dwmw17 --workdir=runs/srnets_mask_poe70_dwmw17
    # paradigm 3 on the synthetic default
    python -m moddiffy_jax.main --config=configs/srnets_mask.py --workdir=runs/srnets_mask
    # MNLI -> HANS with the word-overlap bias model (files from the user)
    python -m moddiffy_jax.main --config=configs/srnets_mask.py:data=mnli,loss=poe \
        --config.data.path=/data/MNLI --config.eval.ood.hans.path=/data/MNLI/hans/heuristics_evaluation_set.txt \
        --config.method.core_run=runs/finetune_mnli --workdir=runs/srnets_mask_mnli

Arguments after ":": data=synthetic|dwmw17|mnli, model=minilm|tiny,
loss=ce|poe|reweighting|conf_reg (conf_reg also needs
--config.method.teacher_run, a finetune run), sparsity=0.2|0.5|0.7|0.9.
Gradual sparsity: --config.srnets.schedule=cubic
--config.srnets.initial_sparsity=0.7 (with sparsity=0.9) and
--config.srnets.init=magnitude_soft. The reference's model selection (the
mask of the best dev evaluation after 70% of training):
--config.train.select=best_dev --config.train.eval_every=50
--config.train.select_from=0.7 (results.json: "selected"). The mask is exported as
export/diffs/mask.safetensors; ``python -m moddiffy_jax.evaluate`` reports the
dense core and core+mask side by side (task, bias-aligned/conflicting
accuracy, leakage, OOD sets).
Measured (2-core CPU, 2026-11-22; BENCHMARKS.md): see the SRNets section.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("srnets_mask", arg)
