"""Full fine-tuning baselines: Finetune and Finetune-debias (joint adversaries/MMD)."""

from moddiffy_jax.methods.common import MethodDef

FINETUNE = MethodDef(
    name="finetune",
    encoder="full",
    debias="none",
    description="All encoder params and the task head trained on the task loss.",
)
FINETUNE_DEBIAS = MethodDef(
    name="finetune_debias",
    encoder="full",
    debias="joint",
    description="Finetune plus every attribute's removal term in the same step.",
)
METHODS = (FINETUNE, FINETUNE_DEBIAS)
