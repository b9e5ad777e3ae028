"""FFW surgery: find a debiased subnetwork of a vanilla model by gating its weights.

"Debiasing surgeon: fantastic weights and how to find them" (Nahon et al.,
ECCV 2024; spec ``srnets_ffw_spec.md`` part B). Starting from a finished run
of this library (the *vanilla* model: ``export/core.safetensors`` and
``export/task_head.safetensors``), every selected weight ``W0`` gets a gate
logit ``m`` and the effective weight ``W0 * min(1, 2 sigmoid(m / T))``
(:mod:`moddiffy_jax.subnets.gates`). The gates minimise

    alpha * CE(task) + gamma * mean_attributes MI(b, softmax(PH(h)))

on an (ideally unbiased) gate-train split, where ``PH`` is a linear bias
extractor ("privacy head") on the representation ``h``. The PH is trained
only on ``CE(PH(stop_gradient(h)), b)``; the MI term reaches the gates
through the attached ``h`` and its gradient into the PH is discarded
(``stop_gradient`` on the PH params). The temperature decays by
``tau_factor`` when the validation MI (with bias labels) stops improving;
the run stops below ``tau_min``. The result is the hard pruning ``m >= 0``,
with no fine-tuning.

Pipeline (spec B6.1)::

    vanilla (frozen, eval mode) -> PH0 trained to a plateau on its features
    m = 0, T = tau0, Adam(m) fresh, PH = PH0, SGD(PH) fresh
    for each gate epoch (<= max_gate_epochs):
      a. one pass over gate-train: gate Adam step + PH SGD step per batch
      b. refine the PH to a plateau (features of the gated net at T)
      c. validation MI of the PH with BIAS labels -> temperature controller
      d. if T changed: hard-prune a copy (m >= 0), train a fresh copy of PH0
         on it to a plateau; keep the gates with the lowest validation bias
         accuracy ("best intermediate"); stop if T < tau_min, else refine
         the PH at the new T
      e. Orbax checkpoint, metrics.jsonl line
    evaluate vanilla, final and best-intermediate gates (fresh PH each);
    export the prunings as SparseDiffs on the vanilla core.

Structure: the numerics are pure jitted functions (:func:`ffw_losses`,
:func:`make_gate_step`, :func:`make_ph_epoch`); the epoch loop, the
temperature controller (:func:`step_temperature`) and the PH plateau rule
(:func:`step_plateau`) are host-side. The temperature is a traced argument,
so a decay never recompiles the step.

Model duck type (``train.build_context(config).model``):
``represent(params, batch, rng, train) -> h [B, H]``,
``task_logits(head, h, rng, train) -> [B, C]``, optionally ``inputs(batch)``
(the model's input arrays of a batch dict; text models use the token-id
keys), ``prunable_rule`` (default gate selection over the encoder params)
and ``structured_followers(encoder_params)`` (per-channel followers of each
kernel, see :func:`moddiffy_jax.subnets.gates.apply_structured_gates`).
Everything runs in eval mode (``train=False``: BN running statistics, no
dropout), as the reference does.

Differences from the released code (renahon/debiasing_surgeon_ffw; details
in ``docs/differences.md``):

* validation MI and bias accuracy, which drive the temperature schedule and
  the best-intermediate choice, use the *bias* labels (the released code
  indexes the task label there, spec B13.1);
* the final evaluation is implemented as intended (a fresh PH on each pruned
  net, B13.2), and a run that never decays reports no best-intermediate
  gates instead of crashing (B13.6);
* a PH has as many outputs as its attribute has classes and the MI is
  normalised by their log (the reference assumes the task's class count);
* PH training runs on cached features of the frozen (gated or pruned) net,
  one forward pass per refinement: identical in eval mode without data
  augmentation;
* an epoch's last, smaller batch is padded with zero-weight rows (weighted CE
  and MI equal the values on the smaller batch; no recompilation);
* shuffles come from ``numpy.random.SeedSequence((seed, stage, epoch, ...))``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from moddiffy_jax import checkpoints
from moddiffy_jax.eval import metrics as metrics_lib
from moddiffy_jax.methods.common import MethodDef
from moddiffy_jax.objectives.classification import cross_entropy
from moddiffy_jax.objectives.mutual_info import mutual_information
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import gates as gates_lib
from moddiffy_jax.subnets import selection

PyTree = Any

# Default gated weights of a BERT encoder: the Dense kernels of every layer
# (Q, K, V, attention output, FFN in and out). Embeddings, LayerNorms,
# biases and the (unused) pooler are never gated.
TEXT_INCLUDE = (
    r"encoder/layer_\d+/(attention/self/(query|key|value)|attention/output/dense"
    r"|intermediate/dense|output/dense)/kernel"
)
_TEXT_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")

FFW = MethodDef(
    name="ffw",
    encoder="frozen",
    debias="none",
    description=(
        "FFW surgery: gates on the frozen weights of a finished run "
        "(config.method.core_run), trained against the MI of a bias extractor, "
        "then hard-pruned (run_ffw; not the shared step loop)."
    ),
)
METHODS = (FFW,)

# Seed-sequence tags of the shuffles (all derived from config.seed).
(_TAG_PH0, _TAG_GATE, _TAG_REFINE, _TAG_PRUNED, _TAG_RETUNE, _TAG_FINAL, _TAG_BEST) = (
    range(7)
)


def default_ffw_config(kind: str = "text") -> ml_collections.ConfigDict:
    """Every FFW field, with the reference defaults (spec B11).

    Args:
      kind: "text" (splits train/dev/test; gate the encoder's Dense kernels;
        head not gated; no bias-conflicting subset) or "vision" (splits
        gate_train/gate_val/test, all unbiased; every kernel including the
        classifier; bias-conflicting accuracy reported).

    Returns:
      An unlocked ConfigDict, to attach as ``config.ffw``.
    """
    if kind not in ("text", "vision"):
        raise ValueError(f"kind must be 'text' or 'vision', got {kind!r}.")
    vision = kind == "vision"
    c = ml_collections.ConfigDict()
    # Objective.
    c.alpha = 1.0
    c.gamma = 10.0
    # Gate optimiser: torch Adam with coupled L2 (never reset on a decay).
    c.lr = 1e-3
    c.wd = 1e-4
    c.b1 = 0.9
    c.b2 = 0.999
    c.eps = 1e-8
    # Temperature controller (ReduceTempOnPlateau).
    c.tau0 = 1.0
    c.tau_factor = 0.1
    c.tau_patience = 5
    c.tau_threshold = 0.05
    c.tau_min = 1e-8
    c.max_gate_epochs = 200
    # Bias extractor (PH): SGD with coupled L2, trained to a plateau.
    c.ph_lr = 0.1
    c.ph_momentum = 0.9
    c.ph_wd = 1e-4
    c.ph_patience = 5
    c.ph_threshold = 1e-3
    c.ph_max_epochs = 200
    # Batches of gate epochs, PH epochs and the per-batch validation MI.
    c.batch_size = 100
    # Gates.
    c.structured = False
    c.include = ()  # regexes over encoder param paths; empty: the model's default
    c.exclude = ()
    c.gate_head = vision  # the reference gates the final fc as well
    c.head_include = (r".*kernel",)
    c.head_exclude = ()
    # Data.
    c.splits = ml_collections.ConfigDict(
        {
            "gate_train": "gate_train" if vision else "train",
            "gate_val": "gate_val" if vision else "dev",
            "test": "test",
        }
    )
    c.attributes = ()  # empty: the run's attributes (config.method.attributes)
    # > 0: gate-train on a fixed random subset of this many examples (CPU runs
    # of a BERT encoder; the subset is drawn once from config.seed).
    c.max_gate_train_examples = 0
    # Copy the core run's exported diffs (e.g. MoDDiffy attribute diffs) into
    # this run's export/diffs, so `evaluate` shows them and the FFW pruning
    # side by side on the same core.
    c.with_core_diffs = not vision
    # Accuracy on examples whose bias label differs from the task label
    # (needs bias and task to share their classes: BMNIST, CelebA, ...).
    c.conflicting = vision
    return c


# -----------------------------------------------------------------------------
# Host-side controllers.
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TemperatureState:
    """State of the reference ``ReduceTempOnPlateau`` (spec B6).

    Attributes:
      temperature: the current ``T``.
      best: best metric so far (None before the first call); never reset.
      num_bad: consecutive epochs without a relative improvement.
    """

    temperature: float
    best: float | None = None
    num_bad: int = 0


def step_temperature(
    state: TemperatureState,
    metric: float,
    *,
    factor: float,
    patience: int,
    threshold: float,
) -> tuple[TemperatureState, bool]:
    """One controller step with the epoch's validation MI.

    The first call only sets ``best``. Afterwards an epoch is *bad* if
    ``metric >= (1 - threshold) * best`` (or ``best < 0``); otherwise
    ``best = metric``. After more than ``patience`` bad epochs in a row,
    ``T <- factor * T`` and the count restarts; ``best`` is kept.

    Returns:
      ``(new_state, changed)``.
    """
    metric = float(metric)
    if state.best is None:
        return dataclasses.replace(state, best=metric, num_bad=0), False
    if metric >= (1.0 - threshold) * state.best or state.best < 0:
        best, num_bad = state.best, state.num_bad + 1
    else:
        best, num_bad = metric, 0
    if num_bad > patience:
        return TemperatureState(state.temperature * factor, best, 0), True
    return TemperatureState(state.temperature, best, num_bad), False


@dataclasses.dataclass(frozen=True)
class PlateauState:
    """The reference ``PlateauDetector`` (lower is better)."""

    best: float | None = None
    num_bad: int = 0


def step_plateau(state: PlateauState, loss: float, *, threshold: float) -> PlateauState:
    """An epoch is bad if ``loss > (1 - threshold) * best``; else it sets ``best``.

    Training stops once ``num_bad > patience``.
    """
    loss = float(loss)
    if state.best is not None and loss > (1.0 - threshold) * state.best:
        return PlateauState(state.best, state.num_bad + 1)
    return PlateauState(loss, 0)


# -----------------------------------------------------------------------------
# Bias extractor (PH) and optimisers.
# -----------------------------------------------------------------------------


def init_bias_heads(
    rng: jax.Array, feature_dim: int, attr_classes: Mapping[str, int]
) -> dict[str, dict[str, jax.Array]]:
    """One linear PH per attribute, torch ``nn.Linear`` default init.

    Returns:
      ``{attr: {"kernel": [H, C_attr], "bias": [C_attr]}}`` (float32).
    """
    bound = 1.0 / math.sqrt(feature_dim)
    out = {}
    for i, (attr, n) in enumerate(sorted(attr_classes.items())):
        kk, kb = jax.random.split(jax.random.fold_in(rng, i))
        out[attr] = {
            "kernel": jax.random.uniform(
                kk, (feature_dim, n), jnp.float32, -bound, bound
            ),
            "bias": jax.random.uniform(kb, (n,), jnp.float32, -bound, bound),
        }
    return out


def bias_logits(head: Mapping[str, jax.Array], h: jax.Array) -> jax.Array:
    """Logits ``h @ kernel + bias`` of one PH; h [B, H] -> [B, C]."""
    return h.astype(jnp.float32) @ head["kernel"] + head["bias"]


def make_gate_optimizer(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """torch ``Adam(lr, weight_decay=wd)``: L2 added to the gradient (coupled)."""
    return optax.chain(
        optax.add_decayed_weights(cfg.wd),
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        optax.scale(-cfg.lr),
    )


def make_ph_optimizer(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """torch ``SGD(lr, momentum, weight_decay)`` (coupled L2, no dampening)."""
    return optax.chain(
        optax.add_decayed_weights(cfg.ph_wd),
        optax.sgd(cfg.ph_lr, momentum=cfg.ph_momentum),
    )


def bias_ce(
    ph: Mapping[str, Any],
    h: jax.Array,
    bias: Mapping[str, jax.Array],
    weight: jax.Array,
) -> jax.Array:
    """Sum over attributes of the weighted mean CE of each PH."""
    return sum(
        cross_entropy(bias_logits(ph[a], h), bias[a], weight) for a in sorted(ph)
    )


# -----------------------------------------------------------------------------
# Jitted numerics.
# -----------------------------------------------------------------------------


@flax.struct.dataclass
class GateTrainState:
    """What a gate step changes.

    Attributes:
      logits: gate logits, a subtree of ``{"encoder": ..., "task_head": ...}``.
      gate_opt: the gates' Adam state.
      ph: ``{attr: {"kernel", "bias"}}`` bias extractors.
      ph_opt: their SGD (momentum) state; it persists across refinements.
    """

    logits: PyTree
    gate_opt: PyTree
    ph: PyTree
    ph_opt: PyTree


ApplyFn = Callable[[PyTree, PyTree, jax.Array], PyTree]


def ffw_losses(
    logits: PyTree,
    ph: PyTree,
    base: PyTree,
    inputs: Mapping[str, Any],
    task: jax.Array,
    bias: Mapping[str, jax.Array],
    weight: jax.Array,
    temperature: jax.Array,
    *,
    model: Any,
    apply_fn: ApplyFn,
    alpha: float,
    gamma: float,
    attr_classes: Mapping[str, int],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Gate objective plus the PH's own CE, built so each gets its own gradient.

    ``total = [alpha CE(task) + gamma mean_a MI_a(sg(PH_a), h)] + sum_a
    CE(PH_a(sg(h)), b_a)``. Differentiating ``total`` with respect to
    ``(logits, ph)`` gives the gates the gradient of the bracket (task CE and
    the attached MI path) and the PH only the gradient of its CE on detached
    features (spec B5 steps 3-5).

    Args:
      logits: gate logits (subtree of ``base``).
      ph: ``{attr: {"kernel", "bias"}}``.
      base: ``{"encoder": params, "task_head": params}`` (frozen).
      inputs: the model's input arrays of a batch.
      task: [B] int task labels.
      bias: ``{attr: [B] int}`` bias labels.
      weight: [B] float, 0 for padding rows.
      temperature: scalar ``T`` (traced).
      model: the model (static).
      apply_fn: ``(base, logits, T) -> effective params``.
      alpha, gamma: loss weights.
      attr_classes: ``{attr: C}``.

    Returns:
      ``(total, aux)`` with aux keys ``task_ce``, ``mi``, ``mi/<attr>``,
      ``ph_ce``, ``objective`` (the gate objective).
    """
    params = apply_fn(base, logits, temperature)
    h = model.represent(params["encoder"], inputs, None, False)
    task_ce = cross_entropy(
        model.task_logits(params["task_head"], h, None, False), task, weight
    )
    frozen_ph = jax.lax.stop_gradient(ph)
    mis = {
        a: mutual_information(
            bias[a],
            jax.nn.softmax(bias_logits(frozen_ph[a], h)),
            num_classes=attr_classes[a],
            weights=weight,
        )
        for a in sorted(attr_classes)
    }
    mi = sum(mis.values()) / len(mis)
    objective = alpha * task_ce + gamma * mi
    ph_ce = bias_ce(ph, jax.lax.stop_gradient(h), bias, weight)
    aux = {"task_ce": task_ce, "mi": mi, "ph_ce": ph_ce, "objective": objective}
    aux.update({f"mi/{a}": v for a, v in mis.items()})
    return objective + ph_ce, aux


def make_gate_step(
    *,
    model: Any,
    apply_fn: ApplyFn,
    gate_opt: optax.GradientTransformation,
    ph_opt: optax.GradientTransformation,
    alpha: float,
    gamma: float,
    attr_classes: Mapping[str, int],
) -> Callable:
    """The (unjitted) gate step ``(state, base, inputs, task, bias, weight, T)``.

    One backward pass of :func:`ffw_losses`; then the gates' Adam step and the
    PH's SGD step. Returns ``(new_state, aux)``.
    """

    def step(state: GateTrainState, base, inputs, task, bias, weight, temperature):
        def loss(logits, ph):
            return ffw_losses(
                logits,
                ph,
                base,
                inputs,
                task,
                bias,
                weight,
                temperature,
                model=model,
                apply_fn=apply_fn,
                alpha=alpha,
                gamma=gamma,
                attr_classes=attr_classes,
            )

        (_, aux), (g_logits, g_ph) = jax.value_and_grad(
            loss, argnums=(0, 1), has_aux=True
        )(state.logits, state.ph)
        upd, gate_state = gate_opt.update(g_logits, state.gate_opt, state.logits)
        logits = optax.apply_updates(state.logits, upd)
        upd, ph_state = ph_opt.update(g_ph, state.ph_opt, state.ph)
        ph = optax.apply_updates(state.ph, upd)
        return GateTrainState(logits, gate_state, ph, ph_state), aux

    return step


def make_ph_epoch(ph_opt: optax.GradientTransformation) -> Callable:
    """One PH epoch on cached features: ``(ph, opt, feats, labels, idx, w)``.

    Args (of the returned function):
      ph: ``{attr: {"kernel", "bias"}}``.
      opt: its SGD state.
      feats: [N, H] features (already detached: they are data here).
      labels: ``{attr: [N] int}``.
      idx: [num_batches, B] int32 row indices (the epoch's shuffle, padded).
      w: [num_batches, B] float32 weights (0 for padding).

    Returns:
      ``(ph, opt, mean_loss)``, the mean over real examples of the summed
      per-attribute CE (per-batch weighted means, weighted by batch size).
    """

    def epoch(ph, opt, feats, labels, idx, w):
        def body(carry, xs):
            ph, opt = carry
            i, wb = xs
            h = feats[i]
            b = {a: v[i] for a, v in labels.items()}
            loss, g = jax.value_and_grad(bias_ce)(ph, h, b, wb)
            upd, opt = ph_opt.update(g, opt, ph)
            return (optax.apply_updates(ph, upd), opt), loss * jnp.sum(wb)

        (ph, opt), losses = jax.lax.scan(body, (ph, opt), (idx, w))
        return ph, opt, jnp.sum(losses) / jnp.maximum(jnp.sum(w), 1.0)

    return epoch


def batched_mutual_information(
    labels: jax.Array, probs: jax.Array, weight: jax.Array, *, num_classes: int
) -> tuple[jax.Array, jax.Array]:
    """Per-batch MI over ``[K, B]`` chunks: returns ``([K] mi, [K] sizes)``."""
    mi = jax.vmap(
        lambda y, p, w: mutual_information(y, p, num_classes=num_classes, weights=w)
    )(labels, probs, weight)
    return mi, jnp.sum(weight, axis=1)


# -----------------------------------------------------------------------------
# Helpers.
# -----------------------------------------------------------------------------


def _epoch_batches(n: int, batch_size: int, seed_words: Sequence[int]):
    """A shuffled epoch as ``[num_batches, B]`` indices and weights (padded)."""
    perm = np.random.default_rng(np.random.SeedSequence(list(seed_words))).permutation(
        n
    )
    return _pad_rows(perm, batch_size)


def _pad_rows(order: np.ndarray, batch_size: int):
    n = len(order)
    nb = max(-(-n // batch_size), 1)
    pad = nb * batch_size - n
    idx = np.concatenate([order, np.zeros(pad, order.dtype)]).astype(np.int32)
    w = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    return idx.reshape(nb, batch_size), w.reshape(nb, batch_size)


def model_inputs(model: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The model's input arrays of a batch dict (``model.inputs`` if it has one)."""
    if hasattr(model, "inputs"):
        return dict(model.inputs(batch))
    return {k: batch[k] for k in _TEXT_INPUT_KEYS if k in batch}


def gate_selection(
    cfg: ml_collections.ConfigDict, model: Any, core: PyTree, head: PyTree
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Encoder include/exclude rules and the gated paths of the combined tree.

    Returns:
      ``(include, exclude, paths)``: the encoder-relative rules (defaults
      filled in) and the gated paths in ``{"encoder", "task_head"}`` form.
    """
    include = tuple(cfg.include)
    if not include:
        rule = getattr(model, "prunable_rule", None)
        if rule is None:
            include = (TEXT_INCLUDE,)
        else:
            include = (rule,) if isinstance(rule, str) else tuple(rule)
    exclude = tuple(cfg.exclude)
    paths = [
        f"encoder/{p}" for p in selection.select_paths(core, include, exclude=exclude)
    ]
    if cfg.gate_head:
        paths += [
            f"task_head/{p}"
            for p in selection.select_paths(
                head, tuple(cfg.head_include), exclude=tuple(cfg.head_exclude)
            )
        ]
    return include, exclude, tuple(paths)


def gate_followers(
    model: Any, core: PyTree, head: PyTree, paths: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """Per-channel followers of the gated kernels, as combined-tree paths."""
    enc = [p[len("encoder/") :] for p in paths if p.startswith("encoder/")]
    hd = [p[len("task_head/") :] for p in paths if p.startswith("task_head/")]
    if hasattr(model, "structured_followers"):
        given = {k: tuple(v) for k, v in dict(model.structured_followers(core)).items()}
        enc_f = {p: given.get(p, ()) for p in enc}
    else:
        enc_f = gates_lib.default_followers(core, enc)
    out = {f"encoder/{k}": tuple(f"encoder/{f}" for f in v) for k, v in enc_f.items()}
    for k, v in gates_lib.default_followers(head, hd).items():
        out[f"task_head/{k}"] = tuple(f"task_head/{f}" for f in v)
    return out


def _split_part(tree: Mapping[str, Any], part: str) -> dict[str, Any]:
    return dict(tree.get(part, {}))


def _to_float(x: Any) -> float:
    return float(np.asarray(jax.device_get(x)))


# -----------------------------------------------------------------------------
# The surgeon: jitted pieces bound to one model, data and config.
# -----------------------------------------------------------------------------


class _Surgeon:
    """Holds the context, the frozen base and the compiled pieces of one run."""

    def __init__(self, config: ml_collections.ConfigDict, ctx: Any, core, head):
        self.config = config
        self.cfg = config.ffw if "ffw" in config else default_ffw_config()
        cfg = self.cfg
        self.ctx = ctx
        self.model = model = ctx.model
        # On device once: the jitted steps take the frozen base as an argument.
        self.base = jax.tree.map(jnp.asarray, {"encoder": core, "task_head": head})
        self.attributes = tuple(cfg.attributes) or tuple(ctx.attributes)
        attr_classes = {a: len(ctx.data.attr_classes[a]) for a in self.attributes}
        self.attr_classes = attr_classes
        self.num_task_classes = len(ctx.data.task_classes)
        if cfg.conflicting:
            bad = [a for a, n in attr_classes.items() if n != self.num_task_classes]
            if bad:
                raise ValueError(
                    f"ffw.conflicting needs bias attributes with the task's "
                    f"{self.num_task_classes} classes; {bad} differ. Set "
                    "config.ffw.conflicting=False."
                )
        self.splits = {k: cfg.splits[k] for k in ("gate_train", "gate_val", "test")}
        missing = [s for s in self.splits.values() if s not in ctx.data.splits]
        if missing:
            raise ValueError(
                f"config.ffw.splits names {missing}; the dataset has "
                f"{sorted(ctx.data.splits)}."
            )
        self.include, self.exclude, self.paths = gate_selection(cfg, model, core, head)
        rules = [re.escape(p) for p in self.paths]
        self.init_logits = gates_lib.init_gates(
            self.base, rules, structured=cfg.structured
        ).logits
        self.followers = (
            gate_followers(model, core, head, self.paths) if cfg.structured else {}
        )
        followers = self.followers
        if cfg.structured:

            def apply_fn(base, logits, t):
                return gates_lib.apply_structured_gates(
                    base,
                    gates_lib.GateState(logits),
                    temperature=t,
                    followers=followers,
                )

            def prune_fn(base, logits):
                return gates_lib.apply_structured_pruning(
                    base, gates_lib.GateState(logits), followers=followers
                )

        else:

            def apply_fn(base, logits, t):
                return gates_lib.apply_gates(
                    base, gates_lib.GateState(logits), temperature=t
                )

            def prune_fn(base, logits):
                return gates_lib.apply_pruning(base, gates_lib.GateState(logits))

        self.gate_opt = make_gate_optimizer(cfg)
        self.ph_opt = make_ph_optimizer(cfg)
        self.apply = jax.jit(apply_fn)
        self.prune = jax.jit(prune_fn)
        self.gate_step = jax.jit(
            make_gate_step(
                model=model,
                apply_fn=apply_fn,
                gate_opt=self.gate_opt,
                ph_opt=self.ph_opt,
                alpha=cfg.alpha,
                gamma=cfg.gamma,
                attr_classes=attr_classes,
            ),
            donate_argnums=(0,),
        )
        self.ph_epoch = jax.jit(make_ph_epoch(self.ph_opt))

        def features(params, inputs):
            h = model.represent(params["encoder"], inputs, None, False)
            return h, model.task_logits(params["task_head"], h, None, False)

        self.features_fn = jax.jit(features)
        self.mi_fns = {
            a: jax.jit(
                lambda y, p, w, n=n: batched_mutual_information(y, p, w, num_classes=n)
            )
            for a, n in attr_classes.items()
        }
        self._labels: dict[str, dict[str, np.ndarray]] = {}

    # -- data ---------------------------------------------------------------

    def seed_words(self, *tags: int) -> tuple[int, ...]:
        return (int(self.config.seed), *(int(t) for t in tags))

    def batch_arrays(self, batch: Mapping[str, Any], weight: np.ndarray):
        inputs = model_inputs(self.model, batch)
        task = np.asarray(batch["task"], np.int32)
        bias = {a: np.asarray(batch["attrs"][a], np.int32) for a in self.attributes}
        return inputs, task, bias, np.asarray(weight, np.float32)

    def feature_dim(self) -> int:
        split = self.ctx.data.splits[self.splits["gate_train"]]
        batch = split.take(np.zeros(1, np.int64))
        h, _ = jax.eval_shape(
            self.features_fn, self.base, model_inputs(self.model, batch)
        )
        return int(h.shape[-1])

    def features(
        self, params: PyTree, split_name: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Features [N, H] and task logits [N, C] of a split (in order)."""
        from moddiffy_jax.data import eval_batches

        split = self.ctx.data.splits[split_name]
        n = len(split)
        hs, logits = [], []
        labels = {"task": []} | {a: [] for a in self.attributes}
        for batch in eval_batches(split, self.config.eval.batch_size):
            h, lg = self.features_fn(params, model_inputs(self.model, batch))
            hs.append(h)
            logits.append(lg)
            if split_name not in self._labels:
                labels["task"].append(np.asarray(batch["task"]))
                for a in self.attributes:
                    labels[a].append(np.asarray(batch["attrs"][a]))
        if split_name not in self._labels:
            self._labels[split_name] = {
                k: np.concatenate(v)[:n].astype(np.int32) for k, v in labels.items()
            }
        h = np.concatenate(jax.device_get(hs))[:n]
        return h, np.concatenate(jax.device_get(logits))[:n]

    def labels(self, split_name: str) -> dict[str, np.ndarray]:
        if split_name not in self._labels:
            self.features(self.base, split_name)
        return self._labels[split_name]

    # -- PH -------------------------------------------------------------------

    def train_ph(
        self, ph: PyTree, opt_state: PyTree, feats: np.ndarray, tags: Sequence[int]
    ) -> tuple[PyTree, PyTree, int]:
        """Trains the PH on cached gate-train features until the CE plateaus."""
        cfg = self.cfg
        labels = self.labels(self.splits["gate_train"])
        bias = {a: jnp.asarray(labels[a]) for a in self.attributes}
        feats = jnp.asarray(feats)
        plateau = PlateauState()
        epochs = 0
        for e in range(cfg.ph_max_epochs):
            idx, w = _epoch_batches(
                len(feats), cfg.batch_size, self.seed_words(*tags, e)
            )
            ph, opt_state, loss = self.ph_epoch(ph, opt_state, feats, bias, idx, w)
            epochs = e + 1
            plateau = step_plateau(plateau, _to_float(loss), threshold=cfg.ph_threshold)
            if plateau.num_bad > cfg.ph_patience:
                break
        return ph, opt_state, epochs

    def fresh_ph(self, ph0: PyTree, feats: np.ndarray, tags: Sequence[int]):
        ph = jax.tree.map(jnp.copy, ph0)
        ph, _, epochs = self.train_ph(ph, self.ph_opt.init(ph), feats, tags)
        return ph, epochs

    def leakage(self, ph: PyTree, feats: np.ndarray, split_name: str) -> dict[str, Any]:
        """MI (per-batch plug-in, bias labels) and bias accuracy of ``ph``."""
        labels = self.labels(split_name)
        idx, w = _pad_rows(np.arange(len(feats)), self.cfg.batch_size)
        out: dict[str, Any] = {"mi": {}, "bias_acc": {}}
        for a in self.attributes:
            logits = np.asarray(bias_logits(ph[a], jnp.asarray(feats)))
            probs = np.asarray(jax.nn.softmax(logits))
            mi, sizes = self.mi_fns[a](labels[a][idx], probs[idx], w)
            mi, sizes = np.asarray(mi, np.float64), np.asarray(sizes, np.float64)
            out["mi"][a] = float(np.sum(mi * sizes) / np.sum(sizes))
            out["bias_acc"][a] = metrics_lib.accuracy(labels[a], logits.argmax(-1))
        out["mean_mi"] = float(np.mean(list(out["mi"].values())))
        out["mean_bias_acc"] = float(np.mean(list(out["bias_acc"].values())))
        return out

    def task_report(self, logits: np.ndarray, split_name: str) -> dict[str, float]:
        """Task accuracy, group-mean ("unbiased") and bias-conflicting accuracy."""
        labels = self.labels(split_name)
        y, pred = labels["task"], logits.argmax(-1)
        report = {"accuracy": metrics_lib.accuracy(y, pred)}
        for a in self.attributes:
            b = labels[a]
            cells = [
                float(np.mean(pred[m] == y[m]))
                for m in (
                    (y == c) & (b == g) for c in np.unique(y) for g in np.unique(b)
                )
                if m.any()
            ]
            report[f"{a}/unbiased_accuracy"] = float(np.mean(cells))
            if self.cfg.conflicting:
                acc = metrics_lib.bias_aligned_conflicting_accuracy(y, pred, b == y)
                report[f"{a}/aligned_accuracy"] = acc["aligned"]
                report[f"{a}/conflicting_accuracy"] = acc["conflicting"]
        return report

    def evaluate(
        self, params: PyTree, ph0: PyTree, tags: Sequence[int] | None
    ) -> dict[str, Any]:
        """Task metrics on gate-val and test, and the leakage of a fresh PH.

        ``tags=None`` evaluates ``ph0`` itself (the vanilla model's PH0);
        otherwise a copy of ``ph0`` is trained to a plateau on ``params``.
        """
        out: dict[str, Any] = {"eval": {}}
        feats = {}
        for key in ("gate_val", "test"):
            name = self.splits[key]
            if name not in feats:
                feats[name], logits = self.features(params, name)
                out["eval"][name] = self.task_report(logits, name)
        ph, epochs = ph0, 0
        if tags is not None:
            train_feats, _ = self.features(params, self.splits["gate_train"])
            ph, epochs = self.fresh_ph(ph0, train_feats, tags)
        val = self.splits["gate_val"]
        out["leakage"] = self.leakage(ph, feats[val], val)
        out["leakage"]["ph_epochs"] = epochs
        return out


# -----------------------------------------------------------------------------
# The driver.
# -----------------------------------------------------------------------------


def _pruning_summary(surgeon: _Surgeon, logits: PyTree) -> dict[str, Any]:
    overall, per_leaf = gates_lib.pruned_fraction(
        gates_lib.GateState(logits), params=surgeon.base
    )
    return {
        "pruned_fraction": _to_float(overall),
        "pruned_fraction_per_layer": {k: _to_float(v) for k, v in per_leaf.items()},
    }


def _export_pruning(
    surgeon: _Surgeon,
    logits: PyTree,
    directory: Path,
    diff_path: Path,
    name: str,
    info: Mapping[str, Any],
    core_meta: Mapping[str, Any],
) -> dict[str, Any]:
    """Writes the pruning of ``logits`` as a SparseDiff on the core (+ head, gates)."""
    state = gates_lib.GateState(logits)
    masks = gates_lib.pruning_masks(
        surgeon.base, state, followers=surgeon.followers or None
    )
    masks = jax.device_get(masks)
    core, head = surgeon.base["encoder"], surgeon.base["task_head"]
    sd = diffs_lib.pruning_diff(
        core,
        _split_part(masks, "encoder"),
        name=name,
        rules=(surgeon.include, surgeon.exclude),
        info=dict(info),
    )
    diff_path.parent.mkdir(parents=True, exist_ok=True)
    diffs_lib.save_sparse_diff(diff_path, sd, overwrite=True)
    out = {
        "path": str(diff_path),
        "nnz": int(sd.nnz()),
        "num_selected": int(sd.num_selected()),
        "density": float(sd.density()),
    }
    meta = {**core_meta, **{k: v for k, v in info.items() if isinstance(v, str)}}
    if "task_head" in masks:
        pruned_head = selection.map_subtree(
            lambda w, k: np.where(k, w, np.zeros_like(w)), head, masks["task_head"]
        )
        path = directory / "task_head_pruned.safetensors"
        checkpoints.save_params(path, pruned_head, metadata=meta, overwrite=True)
        out["task_head_pruned"] = str(path)
    gates_path = directory / f"{name}_gates.safetensors"
    checkpoints.save_params(
        gates_path, jax.device_get(logits), metadata=meta, overwrite=True
    )
    out["gates"] = str(gates_path)
    return out


def run_ffw(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Runs FFW surgery on ``config.method.core_run`` in ``workdir`` (resumable).

    Args:
      config: an experiment config with ``method.core_run`` (a finished run
        directory of this library), ``ffw`` (:func:`default_ffw_config`),
        ``seed``, ``eval.batch_size``, ``train.keep_checkpoints``,
        ``train.progress`` and ``train.stop_at_step`` (> 0: simulate a
        preemption after that many *gate epochs*).
      workdir: the run directory; a checkpoint there is resumed.

    Returns:
      The results, also written to ``workdir/results.json``.

    Raises:
      train.Preempted: when ``config.train.stop_at_step`` stops the run.
    """
    from moddiffy_jax import train

    wall_start = time.time()
    workdir = Path(workdir)
    train.prepare_workdir(config, workdir)
    ctx = train.build_context(config)
    core, head, fp = train._load_core_run(config.method.core_run)
    train._check_same_structure(core, ctx.pretrained, config.method.core_run)
    _, core_meta = checkpoints.load_params(
        Path(config.method.core_run) / "export" / "core.safetensors"
    )
    core_meta = dict(core_meta)
    core_meta.setdefault("fingerprint", diffs_lib.fingerprint(core))
    ctx = _limit_gate_train(ctx, config)
    surgeon = _Surgeon(config, ctx, core, head)
    cfg = surgeon.cfg

    ph0_init = init_bias_heads(
        jax.random.PRNGKey(config.seed), surgeon.feature_dim(), surgeon.attr_classes
    )
    logits0 = surgeon.init_logits
    state = GateTrainState(
        logits=logits0,
        gate_opt=surgeon.gate_opt.init(logits0),
        ph=ph0_init,
        ph_opt=surgeon.ph_opt.init(ph0_init),
    )
    saved = {
        "train": state,
        "ph0": ph0_init,
        "best_logits": jax.tree.map(jnp.copy, logits0),
    }
    meta: dict[str, Any] = {
        "epoch": 0,
        "temperature": float(cfg.tau0),
        "tau_best": None,
        "tau_num_bad": 0,
        "done": False,
        "stop_reason": None,
        "best_epoch": None,
        "best_score": None,
        "temperature_history": [],
        "decays": [],
        "ph0_epochs": 0,
    }
    ckpt = checkpoints.RunCheckpointer(
        workdir / "checkpoints", max_to_keep=config.train.keep_checkpoints
    )
    writer = train.MetricWriter(workdir)
    try:
        latest = ckpt.latest_step()
        if latest is not None:
            meta, _ = ckpt.restore_meta(latest)
            saved = ckpt.restore_state(latest, saved)
            logging.info("FFW: resuming after gate epoch %d.", meta["epoch"])
        else:
            feats, _ = surgeon.features(surgeon.base, surgeon.splits["gate_train"])
            ph0, _, meta["ph0_epochs"] = surgeon.train_ph(
                ph0_init, surgeon.ph_opt.init(ph0_init), feats, (_TAG_PH0,)
            )
            saved["ph0"] = ph0
            saved["train"] = state.replace(
                ph=jax.tree.map(jnp.copy, ph0), ph_opt=surgeon.ph_opt.init(ph0)
            )
        _gate_loop(surgeon, saved, meta, ckpt, writer, config)
        ckpt.wait()
    finally:
        ckpt.close()
        writer.close()
    results = _finish(surgeon, saved, meta, workdir, fp, core_meta, config)
    if cfg.with_core_diffs:
        results["core_diffs"] = _copy_core_diffs(config.method.core_run, workdir, fp)
    results["wall_time_s"] = time.time() - wall_start
    checkpoints.write_json_atomic(workdir / "results.json", results)
    return results


def _subset_split(split: Any, indices: np.ndarray) -> Any:
    """The rows ``indices`` of a TokenizedSplit or ImageSplit (arrays and dicts)."""
    changes = {}
    for field in dataclasses.fields(split):
        value = getattr(split, field.name)
        if isinstance(value, np.ndarray):
            changes[field.name] = value[indices]
        elif isinstance(value, dict):
            changes[field.name] = {k: v[indices] for k, v in value.items()}
    return dataclasses.replace(split, **changes)


def _limit_gate_train(ctx: Any, config: ml_collections.ConfigDict) -> Any:
    """``ctx`` with the gate-train split cut to ``ffw.max_gate_train_examples``."""
    limit = int(config.ffw.max_gate_train_examples)
    name = config.ffw.splits.gate_train
    split = ctx.data.splits[name] if name in ctx.data.splits else None
    if limit <= 0 or split is None or len(split) <= limit:
        return ctx
    order = np.random.default_rng(config.seed).permutation(len(split))[:limit]
    splits = {**ctx.data.splits, name: _subset_split(split, np.sort(order))}
    return dataclasses.replace(ctx, data=dataclasses.replace(ctx.data, splits=splits))


def _copy_core_diffs(core_run: str, workdir: Path, fp: str) -> list[str]:
    """Copies the core run's exported diffs made on the same core (same fingerprint)."""
    copied = []
    for path in sorted((Path(core_run) / "export" / "diffs").glob("*.safetensors")):
        sd = diffs_lib.load_sparse_diff(str(path))
        if sd.base_fingerprint != fp or sd.name == "ffw":
            continue
        diffs_lib.save_sparse_diff(
            workdir / "export" / "diffs" / path.name, sd, overwrite=True
        )
        copied.append(sd.name)
    return copied


def _gate_loop(
    surgeon: _Surgeon, saved: dict, meta: dict, ckpt, writer, config
) -> None:
    """Gate epochs from ``meta["epoch"]`` on; updates ``saved``/``meta`` in place."""
    from moddiffy_jax import train

    cfg = surgeon.cfg
    split = surgeon.ctx.data.splits[surgeon.splits["gate_train"]]
    n = len(split)
    controller = TemperatureState(
        meta["temperature"], meta["tau_best"], meta["tau_num_bad"]
    )
    progress = _progress(config, cfg.max_gate_epochs, meta["epoch"])
    try:
        while not meta["done"] and meta["epoch"] < cfg.max_gate_epochs:
            epoch = meta["epoch"] + 1
            start = time.time()
            tau = controller.temperature
            state = saved["train"]
            # a. One gate epoch.
            idx, w = _epoch_batches(
                n, cfg.batch_size, surgeon.seed_words(_TAG_GATE, epoch)
            )
            auxes = []
            for rows, wb in zip(idx, w, strict=True):
                arrays = surgeon.batch_arrays(split.take(rows), wb)
                state, aux = surgeon.gate_step(
                    state, surgeon.base, *arrays, jnp.float32(tau)
                )
                auxes.append(aux)
            # Epoch means over real examples (each batch value is a batch mean).
            auxes, sizes = jax.device_get(auxes), w.sum(axis=1)
            record = {
                f"train/{k}": sum(
                    float(a[k]) * float(s) for a, s in zip(auxes, sizes, strict=True)
                )
                / n
                for k in auxes[0]
            }
            # b. Refine the PH on the gated net.
            gated = surgeon.apply(surgeon.base, state.logits, jnp.float32(tau))
            feats, _ = surgeon.features(gated, surgeon.splits["gate_train"])
            ph, ph_opt, record["ph_refine_epochs"] = surgeon.train_ph(
                state.ph, state.ph_opt, feats, (_TAG_REFINE, epoch)
            )
            # c. Validation MI with bias labels -> temperature controller.
            val_name = surgeon.splits["gate_val"]
            val_feats, val_logits = surgeon.features(gated, val_name)
            leak = surgeon.leakage(ph, val_feats, val_name)
            record.update(
                {
                    "val/mi": leak["mean_mi"],
                    "val/bias_acc": leak["mean_bias_acc"],
                    "val/task_acc": surgeon.task_report(val_logits, val_name)[
                        "accuracy"
                    ],
                    "temperature": tau,
                }
            )
            record.update({f"val/mi/{a}": v for a, v in leak["mi"].items()})
            record.update({f"val/bias_acc/{a}": v for a, v in leak["bias_acc"].items()})
            controller, changed = step_temperature(
                controller,
                leak["mean_mi"],
                factor=cfg.tau_factor,
                patience=cfg.tau_patience,
                threshold=cfg.tau_threshold,
            )
            meta["temperature_history"].append([epoch, tau])
            # d. On a temperature change: evaluate the hard pruning.
            if changed:
                pruned = surgeon.prune(surgeon.base, state.logits)
                train_p, _ = surgeon.features(pruned, surgeon.splits["gate_train"])
                fresh, _ = surgeon.fresh_ph(saved["ph0"], train_p, (_TAG_PRUNED, epoch))
                val_p, _ = surgeon.features(pruned, val_name)
                pl = surgeon.leakage(fresh, val_p, val_name)
                score = pl["mean_bias_acc"]
                record.update(
                    {"pruned/val_mi": pl["mean_mi"], "pruned/val_bias_acc": score}
                )
                meta["decays"].append(
                    {
                        "epoch": epoch,
                        "from": tau,
                        "to": controller.temperature,
                        "val_mi": leak["mean_mi"],
                        "pruned_val_bias_acc": score,
                        "pruned_val_mi": pl["mean_mi"],
                    }
                )
                if meta["best_score"] is None or score < meta["best_score"]:
                    meta["best_score"], meta["best_epoch"] = score, epoch
                    saved["best_logits"] = jax.tree.map(jnp.copy, state.logits)
                if controller.temperature < cfg.tau_min:
                    meta["done"], meta["stop_reason"] = True, "tau_min"
                else:
                    gated = surgeon.apply(
                        surgeon.base, state.logits, jnp.float32(controller.temperature)
                    )
                    feats, _ = surgeon.features(gated, surgeon.splits["gate_train"])
                    ph, ph_opt, record["ph_retune_epochs"] = surgeon.train_ph(
                        ph, ph_opt, feats, (_TAG_RETUNE, epoch)
                    )
            saved["train"] = state.replace(ph=ph, ph_opt=ph_opt)
            if not meta["done"] and epoch >= cfg.max_gate_epochs:
                meta["done"], meta["stop_reason"] = True, "max_gate_epochs"
            summary = _pruning_summary(surgeon, state.logits)
            record["pruned_fraction"] = summary["pruned_fraction"]
            record["tau_changed"] = int(changed)
            meta.update(
                epoch=epoch,
                temperature=controller.temperature,
                tau_best=controller.best,
                tau_num_bad=controller.num_bad,
            )
            # e. Checkpoint (async) and log.
            ckpt.save(epoch, saved, meta, {})
            record["epoch_time_s"] = time.time() - start
            writer.write(epoch, record)
            progress.update(1)
            progress.set_postfix(tau=f"{tau:.0e}", mi=f"{leak['mean_mi']:.3f}")
            logging.info(
                "FFW epoch %d: T=%g val MI %.4f bias acc %.4f pruned %.4f",
                epoch,
                tau,
                leak["mean_mi"],
                leak["mean_bias_acc"],
                summary["pruned_fraction"],
            )
            stop_at = int(config.train.stop_at_step)
            if stop_at and epoch >= stop_at and not meta["done"]:
                raise train.Preempted(epoch)
    finally:
        progress.close()


def _progress(config, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="ffw",
        disable=not config.train.progress,
        dynamic_ncols=True,
    )


def _finish(
    surgeon: _Surgeon,
    saved: dict,
    meta: dict,
    workdir: Path,
    fp: str,
    core_meta: Mapping[str, Any],
    config: ml_collections.ConfigDict,
) -> dict:
    """Evaluates vanilla / final / best-intermediate gates and writes the exports."""
    cfg = surgeon.cfg
    export = workdir / "export"
    checkpoints.save_params(
        export / "core.safetensors",
        surgeon.base["encoder"],
        metadata=core_meta,
        overwrite=True,
    )
    checkpoints.save_params(
        export / "task_head.safetensors",
        surgeon.base["task_head"],
        metadata=core_meta,
        overwrite=True,
    )
    ph0 = saved["ph0"]
    results: dict[str, Any] = {
        "method": "ffw",
        "dataset": surgeon.ctx.data.name,
        "attributes": list(surgeon.attributes),
        "core_run": str(config.method.core_run),
        "core_fingerprint": fp,
        "structured": bool(cfg.structured),
        "gated_leaves": list(surgeon.paths),
        "num_gate_epochs": meta["epoch"],
        "stop_reason": meta["stop_reason"],
        "ph0_epochs": meta["ph0_epochs"],
        "temperature_history": [
            {"epoch": e, "temperature": t} for e, t in meta["temperature_history"]
        ],
        "temperature_decays": meta["decays"],
        "final_temperature": meta["temperature"],
    }
    results["vanilla"] = surgeon.evaluate(surgeon.base, ph0, None)
    results["vanilla"]["leakage"]["note"] = "PH0 (trained on the vanilla features)"
    candidates = [("final", saved["train"].logits, meta["epoch"], _TAG_FINAL)]
    if meta["best_epoch"] is not None:
        candidates.append(
            (
                "best_intermediate",
                saved["best_logits"],
                meta["best_epoch"],
                _TAG_BEST,
            )
        )
    else:
        results["best_intermediate"] = None
    for label, logits, epoch, tag in candidates:
        pruned = surgeon.prune(surgeon.base, logits)
        entry = {"epoch": epoch, **_pruning_summary(surgeon, logits)}
        entry.update(surgeon.evaluate(pruned, ph0, (tag,)))
        info = {
            "method": "ffw",
            "gates": label,
            "epoch": epoch,
            "structured": bool(cfg.structured),
        }
        if label == "final":
            entry["export"] = _export_pruning(
                surgeon,
                logits,
                export,
                export / "diffs" / "ffw.safetensors",
                "ffw",
                info,
                core_meta,
            )
        else:
            entry["score_val_bias_acc"] = meta["best_score"]
            directory = export / "ffw_best_intermediate"
            entry["export"] = _export_pruning(
                surgeon,
                logits,
                directory,
                directory / "ffw_best_intermediate.safetensors",
                "ffw_best_intermediate",
                info,
                core_meta,
            )
        results[label] = entry
    results["diffs"] = {
        "ffw": {k: v for k, v in results["final"]["export"].items() if k != "gates"}
    }
    return results
