r"""MoDDiffy-post: one sparse debiasing diff per attribute on the frozen core of a finetune run.

Run (from the repository root)::

    python -m moddiffy_jax.main --config=configs/moddiffy_post.py --workdir=runs/moddiffy_post
    python -m moddiffy_jax.main --config=configs/moddiffy_post.py:data=dwmw17 --workdir=runs/moddiffy_post_dwmw17

Arguments after ":" are comma-separated key=value pairs: data=synthetic|dwmw17
(synthetic is generated in code; dwmw17 reads
../shared/data/dwmw17_dialect by path), model=minilm|tiny,
objective=auto|mmd|adversarial|swap (default auto, since stop 42: the
counterfactual token swaps where a bag-of-tokens read says the attributes'
counterpart words carry them, else the MMD recipe; on the main job's
SYNTHETIC data, samples 0 and 2, each diff then closes more than half of
its gap within 2 points, docs/efficacy.md "Stop 42"; swap: the swaps
whatever the read says, "Stop 39"). Any field can be overridden with
--config.<field>=<value>; the config is locked, so a misspelled field fails.

MoDDiffy-post needs a finished finetune run of the same data and model:
add --config.method.core_run=runs/finetune (its workdir).
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg=None):
    # As the main job: "auto" unless the argument names an objective.
    config = experiment_config("moddiffy_post", arg, objective="auto")
    # Like the main job, the report also builds a token-merge diff per
    # attribute on the frozen core (post hoc, as these diffs are; a few
    # minutes on 2 cores; --config.eval.token_merge.enabled=False turns it
    # off; docs/efficacy.md, "Stop 37").
    config.eval.token_merge.enabled = bool(config.eval.leakage)
    return config
