r"""LoRA baselines: a low-rank task update (lora), or one low-rank removal module
per attribute on a frozen finetune core (lora_debias), exported as diffs.

Run (from the repository root)::

    python -m moddiffy_jax.main --config=configs/lora.py --workdir=runs/lora
    python -m moddiffy_jax.main --config=configs/lora.py:method=lora_debias \
        --config.method.core_run=runs/finetune --workdir=runs/lora_debias

Arguments after ":" are comma-separated key=value pairs: method=lora|
lora_debias (default lora), and those of every config (data=synthetic|
dwmw17, model=minilm|tiny, objective=mmd|adversarial). ``lora_debias``
needs a finished finetune run of the same data and model
(``--config.method.core_run``). Rank, scale and kernels are in
``config.lora`` (``--config.lora.rank=16``).
"""

from moddiffy_jax.config_lib import experiment_config

METHODS = ("lora", "lora_debias")


def get_config(arg=None):
    method, rest = "lora", []
    for item in filter(None, (arg or "").split(",")):
        key, _, value = item.partition("=")
        if key != "method":
            rest.append(item)
        elif value in METHODS:
            method = value
        else:
            raise ValueError(f"method={value!r}; valid values: {METHODS}.")
    return experiment_config(method, ",".join(rest) or None)
