"""LoRA (Hu et al. 2022) and LoRA-debias: low-rank modules that export as diffs.

* ``lora``: the pretrained encoder frozen; a rank-``r`` update
  ``(alpha / r) A B`` on each selected kernel (``config.lora.include``:
  by default the attention query and value kernels, as in the paper) and
  the task head are trained on the task loss. The exported core is the
  pretrained encoder and the update is the ``task`` diff, as for DiffPrun.
* ``lora_debias``: the core and task head of a finished finetune run
  (``config.method.core_run``) stay frozen, as in MoDDiffy-post; one
  low-rank module per protected attribute is trained with the task loss and
  that attribute's removal term (the ``method.objective`` of the run).

At export each module is merged into a dense update of its kernels and
saved as a SparseDiff on the core, so it composes with the core and with
other diffs like any sparse diff (``evaluate``, the composition table). It
is dense on its kernels, not sparse: ``r (in + out)`` trained numbers per
kernel, ``in * out`` stored entries.

The ``A`` factors start Gaussian with standard deviation ``1 / sqrt(in)``
and the ``B`` factors at zero, so training starts from the core. The
modules are trained with the ``diff`` optimiser role (``optim.lr_diff``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moddiffy_jax import checkpoints
from moddiffy_jax.methods import common, standard
from moddiffy_jax.methods.interface import Method
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import selection

PyTree = Any

#: The attention query and value kernels of every layer (the paper's choice).
DEFAULT_INCLUDE = (r"encoder/layer_\d+/attention/self/(query|value)/kernel",)


def default_lora_config() -> ml_collections.ConfigDict:
    """The ``config.lora`` section."""
    c = ml_collections.ConfigDict()
    c.rank = 8
    c.alpha = 16.0  # the update is (alpha / rank) * A @ B.
    c.include = DEFAULT_INCLUDE  # 2-D kernels (paths inside the encoder).
    c.exclude = ()
    return c


def _sections() -> dict[str, ml_collections.ConfigDict]:
    return {"lora": default_lora_config()}


def check_config(config: ml_collections.ConfigDict) -> None:
    if int(config.lora.rank) < 1:
        raise ValueError(f"config.lora.rank={config.lora.rank} must be >= 1.")


def _rules(config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(config.lora.include), tuple(config.lora.exclude)


def init_module(
    encoder: PyTree, config: ml_collections.ConfigDict, rng: jax.Array
) -> dict[str, dict]:
    """``{"a": {path: [in, r]}, "b": {path: [r, out]}}`` over the selected kernels."""
    include, exclude = _rules(config)
    flat = selection.flatten(encoder)
    paths = selection.select_paths(encoder, include, exclude=exclude)
    rank, a, b = int(config.lora.rank), {}, {}
    for i, p in enumerate(paths):
        w = flat[p]
        if np.ndim(w) != 2:
            raise ValueError(
                f"LoRA needs 2-D kernels; {p!r} has shape {np.shape(w)}: "
                "narrow config.lora.include."
            )
        d_in, d_out = np.shape(w)
        key = jax.random.fold_in(rng, i)
        a[p] = jax.random.normal(key, (d_in, rank), w.dtype) / np.sqrt(d_in)
        b[p] = jnp.zeros((rank, d_out), w.dtype)
    return {"a": selection.unflatten(a), "b": selection.unflatten(b)}


def merged_update(module: Mapping[str, Any], scale: Any) -> dict[str, Any]:
    """``{path: scale * A @ B}``: the module's dense update of each kernel."""
    a, b = selection.flatten(module["a"]), selection.flatten(module["b"])
    return {p: scale * (a[p] @ b[p]) for p in a}


def _add(params: PyTree, module: Mapping[str, Any], scale: Any) -> PyTree:
    update = selection.unflatten(merged_update(module, scale))
    return selection.map_subtree(lambda w, u: w + u.astype(w.dtype), params, update)


def encoder_and_head(
    method, trainable, frozen, phase, settings, attribute, rng, *, train
) -> tuple[PyTree, PyTree]:
    """The base plus the task module (``lora``) or the attribute's module."""
    params, scale = frozen["base"], frozen["lora_scale"]
    if "task_diff" in trainable:
        params = _add(params, trainable["task_diff"], scale)
    if attribute is not None:
        params = _add(params, trainable["diffs"][attribute], scale)
    return params, trainable.get("task_head", frozen.get("task_head"))


def _scale(config) -> jax.Array:
    return jnp.float32(float(config.lora.alpha) / int(config.lora.rank))


def _init_task(ctx, rng: jax.Array) -> tuple[dict, dict]:
    r_head, r_mod = jax.random.split(rng)
    trainable = {
        "task_head": ctx.model.init_task_head(r_head),
        "task_diff": init_module(ctx.pretrained, ctx.config, r_mod),
    }
    frozen = {"base": ctx.pretrained, "lora_scale": _scale(ctx.config)}
    return trainable, frozen


def _init_debias(ctx, rng: jax.Array) -> tuple[dict, dict]:
    cfg = ctx.config
    core, head, _ = checkpoints.load_core_run(cfg.method.core_run)
    checkpoints.check_same_structure(core, ctx.pretrained, cfg.method.core_run)
    r_mod, r_adv = jax.random.split(rng)
    trainable = {
        "diffs": {
            a: init_module(core, cfg, jax.random.fold_in(r_mod, i))
            for i, a in enumerate(ctx.attributes)
        }
    }
    trainable.update(standard.removal_parts(ctx, r_adv))
    frozen = {"base": core, "task_head": head, "lora_scale": _scale(cfg)}
    return trainable, frozen


def _task_substeps(ctx, phase: str, trainable: dict) -> list[common.SubStep]:
    loss = common.make_task_loss(
        ctx.model,
        ctx.method,
        phase=phase,
        diff_settings=None,
        debias=None,
        attributes=(),
        task_loss=ctx.config.method.task_loss,
    )
    optimizer = common.make_optimizer(ctx.config.optim)
    return [common.SubStep("task", (("task_diff",), ("task_head",)), loss, optimizer)]


def _debias_substeps(ctx, phase: str, trainable: dict) -> list[common.SubStep]:
    optimizer = common.make_optimizer(ctx.config.optim)
    adversarial = ctx.debias.objective == "adversarial"
    subs = []
    for attr in ctx.attributes:
        updates = (("diffs", attr),) + ((("adversaries", attr),) if adversarial else ())
        loss = common.make_debias_loss(
            ctx.model,
            ctx.method,
            attr,
            phase=phase,
            diff_settings=None,
            debias=ctx.debias,
            task_loss=ctx.config.method.task_loss,
            swap_table=(ctx.swap_tables or {}).get(attr),
        )
        subs.append(common.SubStep(f"debias/{attr}", updates, loss, optimizer))
    return subs


def _model(ctx, trainable: Mapping, frozen: Mapping) -> tuple[PyTree, PyTree]:
    """The exported core is the base; the modules are exported as diffs."""
    return frozen["base"], trainable.get("task_head", frozen.get("task_head"))


def _exports(ctx, trainable: Mapping, frozen: Mapping, phase: str) -> dict:
    modules = {}  # the task module, then the attributes in the run's order
    if "task_diff" in trainable:
        modules["task"] = trainable["task_diff"]
    for attr in ctx.attributes if "diffs" in trainable else ():
        modules[attr] = trainable["diffs"][attr]
    fp = diffs_lib.fingerprint(frozen["base"])
    scale = jax.device_get(frozen["lora_scale"])
    info = {
        "method": ctx.method.name,
        "rank": int(ctx.config.lora.rank),
        "alpha": float(ctx.config.lora.alpha),
    }
    return {
        name: diffs_lib.SparseDiff.from_dense(
            selection.unflatten(
                {
                    p: np.asarray(u)
                    for p, u in merged_update(jax.device_get(m), scale).items()
                }
            ),
            name=name,
            base_fingerprint=fp,
            rules=_rules(ctx.config),
            info=info,
        )
        for name, m in zip(modules, jax.device_get(list(modules.values())), strict=True)
    }


LORA = Method(
    name="lora",
    encoder="lora",
    debias="none",
    description="A low-rank update of the frozen pretrained encoder and the task head.",
    init=_init_task,
    substeps=_task_substeps,
    model=_model,
    exports=_exports,
    encoder_and_head=encoder_and_head,
    check_config=check_config,
    config_sections=_sections,
)
LORA_DEBIAS = Method(
    name="lora_debias",
    encoder="lora",
    debias="modular",
    description="One low-rank removal module per attribute on a frozen finetune core.",
    init=_init_debias,
    substeps=_debias_substeps,
    model=_model,
    exports=_exports,
    encoder_and_head=encoder_and_head,
    check_config=check_config,
    config_sections=_sections,
)
METHODS = (LORA, LORA_DEBIAS)
