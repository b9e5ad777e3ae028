"""The dense family: full fine-tuning and bottleneck adapters, with or without removal.

* ``finetune``: all encoder params and the task head on the task loss.
* ``finetune_debias``: the same plus every attribute's removal term in the
  same step (joint adversaries or MMD).
* ``adapter``, ``adapter_debias``: bottleneck adapters (Pfeiffer et al.)
  after each layer's feed-forward block (``moddiffy_jax.models.bert``,
  ``config.model.adapter_reduction_factor``) and the task head; everything
  else in the encoder is frozen.

One ``train`` phase of ``train.num_steps`` steps; the exported core is the
trained encoder (adapters merged in).
"""

from moddiffy_jax.methods import standard

FINETUNE = standard.method(
    "finetune",
    "full",
    "none",
    "All encoder params and the task head trained on the task loss.",
)
FINETUNE_DEBIAS = standard.method(
    "finetune_debias",
    "full",
    "joint",
    "Finetune plus every attribute's removal term in the same step.",
)
ADAPTER = standard.method(
    "adapter",
    "adapter",
    "none",
    "Adapters and task head trained; the pretrained encoder frozen.",
)
ADAPTER_DEBIAS = standard.method(
    "adapter_debias",
    "adapter",
    "joint",
    "One adapter trained with the task and every removal term.",
)
METHODS = (FINETUNE, FINETUNE_DEBIAS, ADAPTER, ADAPTER_DEBIAS)
