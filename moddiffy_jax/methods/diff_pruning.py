"""Diff pruning (Guo et al. 2021): DiffPrun and DiffPrun-debias.

One sparse task diff on the frozen pretrained encoder, trained with
hard-concrete L0 gates, pruned to an exact budget, then trained in fixmask.
"""

from moddiffy_jax.methods.common import MethodDef

DIFFPRUN = MethodDef(
    name="diffprun",
    encoder="diff",
    debias="none",
    description="A sparse task diff on the frozen pretrained encoder.",
)
DIFFPRUN_DEBIAS = MethodDef(
    name="diffprun_debias",
    encoder="diff",
    debias="joint",
    description="A sparse task diff trained with the task and every removal term.",
)
METHODS = (DIFFPRUN, DIFFPRUN_DEBIAS)
