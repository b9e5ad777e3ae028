"""MoDDiffy (Hauzenberger et al. 2023): one sparse debiasing diff per attribute.

* ``moddiffy_par``: per batch, a task step (core and task head, diffs off),
  then one debias step per attribute (core frozen; that attribute's diff,
  its adversaries and the shared task head trained with the task loss, the
  removal term and the diff's own L0 term).
* ``moddiffy_post``: the core and task head come from a finished finetune
  run (``config.method.core_run``) and stay frozen; one diff per attribute.

Each diff is exported as its own SparseDiff file and can be added to the core
alone or together with others.
"""

from moddiffy_jax.methods.common import MethodDef

MODDIFFY_PAR = MethodDef(
    name="moddiffy_par",
    encoder="full",
    debias="modular",
    description="Core fine-tuned and attribute diffs trained in the same loop.",
)
MODDIFFY_POST = MethodDef(
    name="moddiffy_post",
    encoder="frozen",
    debias="modular",
    description="Attribute diffs on a frozen core from a finetune run.",
)
METHODS = (MODDIFFY_PAR, MODDIFFY_POST)
