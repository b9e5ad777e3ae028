"""Bottleneck adapters (Pfeiffer et al.): Adapter and Adapter-debias.

The adapters sit after each layer's feed-forward block (see
``moddiffy_jax.models.bert``, ``config.model.adapter_reduction_factor``);
everything else in the encoder is frozen.
"""

from moddiffy_jax.methods.common import MethodDef

ADAPTER = MethodDef(
    name="adapter",
    encoder="adapter",
    debias="none",
    description="Adapters and task head trained; the pretrained encoder frozen.",
)
ADAPTER_DEBIAS = MethodDef(
    name="adapter_debias",
    encoder="adapter",
    debias="joint",
    description="One adapter trained with the task and every removal term.",
)
METHODS = (ADAPTER, ADAPTER_DEBIAS)
