r"""SRNets paradigm 2: fine-tune a found subnetwork in isolation.

The pretrained encoder is masked with the mask of another run
(``--config.srnets.mask_run``: an srnets_imp run, e.g. with rewinding, or an
srnets_mask run on a fine-tuned model) and fine-tuned with a new classifier;
pruned weights stay zero::

    python -m moddiffy_jax.main --config=configs/srnets_retrain.py:data=dwmw17,loss=poe \
        --config.srnets.mask_run=runs/srnets_lt_dwmw17 --workdir=runs/srnets_retrain_dwmw17

Arguments after ":" as in configs/srnets_mask.py (sparsity comes from the
mask). The subnetwork is the exported core; the mask is re-exported as
export/mask.safetensors.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    return experiment_config("srnets_retrain", arg)
