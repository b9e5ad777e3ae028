"""FFW weight gates ("Debiasing surgeon", Nahon et al., ECCV 2024).

Every selected weight ``W0`` (frozen) gets gate logits ``m`` (the trainable
state). The effective weight is

    W = W0 * g(m / T),    g(x) = min(1, 2 * sigmoid(x)),

with temperature ``T > 0``. The backward pass uses the derivative of the
*unclamped* ``2 * sigmoid(x)``, i.e. ``2 * sigmoid(x) * (1 - sigmoid(x))``
(times ``1 / T`` by the chain rule), also where the forward value is clamped
at 1. Logits start at 0, where ``g(0) = 1`` exactly, so the gated network
starts equal to the vanilla one. The final pruning rule keeps a weight iff
``m >= 0`` and uses the unscaled ``W0`` (no ``2 * sigmoid`` factor).

Gate layouts. ``logits`` is a subtree of the params (see
:mod:`moddiffy_jax.subnets.selection`):

* unstructured: one logit per weight, shape of the weight;
* structured: one logit per output channel, shape ``[out]`` = the weight's
  last axis: a Flax ``Dense`` kernel ``[in, out]`` -> ``[out]``, a ``Conv``
  kernel ``[kh, kw, in, out]`` -> ``[out]``; a 1-D leaf gets one gate per
  entry (``[n]``), a scalar leaf one gate (``[]``). The gate is broadcast over
  all other axes. The layout is read from the logits' shapes, so structured
  and unstructured leaves may be mixed.

To reproduce the reference selection (every non-BatchNorm ``.weight``,
including the final classifier; never biases or BN affine parameters), use
``include=r".*kernel"`` on Flax Dense/Conv parameters.

Differences from the reference code (renahon/debiasing_surgeon_ffw):

* Structured variant. The released code defines a ``StructuredGate`` that
  multiplies a layer's *output* and is never instantiated. :func:`apply_gates`
  with ``[out]`` logits scales the output channels of the *kernel* only,
  which equals gating the pre-bias, pre-normalisation output: a pruned
  channel still emits its bias, and after an eval-mode BatchNorm a zeroed
  pre-BN channel becomes ``beta - gamma * mu / sigma != 0``. To remove a
  channel entirely use :func:`apply_structured_gates` /
  :func:`apply_structured_pruning` with the kernel's *followers* (see below).
* Structured gates with followers. ``followers`` maps a gated kernel's path
  to the paths of the per-channel parameters that belong to its output
  channels, in the same tree: the layer's own bias and, for a conv followed
  by a BatchNorm, the BN ``scale`` and ``bias`` (each of shape ``[out]``).
  The *soft* gate multiplies the parameters of the last affine of the chain:
  the followers outside the kernel's own module (the BN scale and bias) if
  there are any, otherwise the kernel and its own bias. So the soft-gated
  channel output is ``g * BN(conv(x))`` (the gate after BN, as the spec
  asks; also after a ReLU, since ``relu(g z) = g relu(z)`` for ``g >= 0``) or
  ``g * (x W + b)`` for a layer without BN. *Hard pruning* (``m < 0``) zeroes
  the kernel's output channel and the entry of every follower, so the
  channel's output is exactly 0 after the BN (``0 * (y - mu) / sigma + 0``)
  and after any activation with ``act(0) = 0`` (ReLU, tanh, GELU). At
  ``g = 0`` the soft and hard nets compute the same function.
* Temperature is an ordinary (traceable) argument, so a temperature decay does
  not recompile the train step; the reference recomputes its gated weights
  after each optimizer step and temperature change, which is implicit here.
* The known bugs of the released code (validation MI computed against task
  labels, the crashing pruned-model evaluation; spec section B13) are in the
  training and evaluation loop, not in these pieces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.subnets import selection

PyTree = Any
Array = jax.Array
Followers = Mapping[str, Sequence[str]]


@flax.struct.dataclass
class GateState:
    """FFW gate state.

    Attributes:
      logits: subtree of the params with the gate logits ``m``: per weight
        (the weight's shape) or per output channel (shape ``[out]``, the
        weight's last axis). This is what is trained.
    """

    logits: PyTree


def _gate_shape(shape: tuple[int, ...], structured: bool) -> tuple[int, ...]:
    if not structured or len(shape) <= 1:
        return tuple(shape)
    return (shape[-1],)


def init_gates(
    params: PyTree,
    include: str | Iterable[str],
    *,
    exclude: str | Iterable[str] = (),
    structured: bool = False,
    init: float = 0.0,
    dtype: Any = jnp.float32,
) -> GateState:
    """Gate logits for the selected weights, all fully open at the default init.

    The reference initialises every logit to 0, where
    ``min(1, 2 * sigmoid(0)) = 1`` exactly, at any temperature. Any
    ``init >= 0`` also gives a gate of exactly 1, but a larger value has a
    smaller gradient; keep the default unless you know why.

    Args:
      params: the frozen parameter pytree.
      include: path rules selecting the gated weights.
      exclude: path rules removing leaves from the selection.
      structured: one gate per output channel (last axis) instead of one per
        weight; see the module docstring for shapes.
      init: the initial logit value.
      dtype: the logits' dtype.

    Returns:
      A :class:`GateState` whose ``logits`` subtree covers the selected leaves.
    """
    weights = selection.select(params, include, exclude=exclude)
    logits = jax.tree.map(
        lambda w: jnp.full(_gate_shape(np.shape(w), structured), init, dtype), weights
    )
    return GateState(logits=logits)


@jax.custom_vjp
def two_sigmoid(x: Array) -> Array:
    """``min(1, 2 * sigmoid(x))`` with the gradient of the unclamped ``2 * sigmoid(x)``.

    Forward: ``min(1, 2 * sigmoid(x))``. Backward:
    ``2 * sigmoid(x) * (1 - sigmoid(x))`` everywhere, including where the
    forward value is clamped at 1 (reference ``TwoSigmoid``).
    """
    return jnp.minimum(1.0, 2.0 * jax.nn.sigmoid(x))


def _two_sigmoid_fwd(x: Array) -> tuple[Array, Array]:
    s = jax.nn.sigmoid(x)
    return jnp.minimum(1.0, 2.0 * s), s


def _two_sigmoid_bwd(s: Array, g: Array) -> tuple[Array]:
    return (g * 2.0 * s * (1.0 - s),)


two_sigmoid.defvjp(_two_sigmoid_fwd, _two_sigmoid_bwd)


def gate_values(logits: PyTree, *, temperature: float | Array) -> PyTree:
    """Gate values ``min(1, 2 * sigmoid(m / T))`` (straight-through on the clamp).

    The gradient with respect to ``m`` is ``2 * sigmoid(m/T) * (1 -
    sigmoid(m/T)) / T``, non-zero also where the value is clamped at 1.

    Args:
      logits: a subtree of logit arrays (or a single array).
      temperature: ``T > 0``, a Python float or a (possibly traced) scalar.

    Returns:
      The values, with the structure, shapes and dtypes of ``logits``.
    """
    return jax.tree.map(
        lambda m: two_sigmoid(m / jnp.asarray(temperature, m.dtype)), logits
    )


def _check_broadcast(path_hint: str, w: Array, g: Array) -> None:
    w_shape, g_shape = np.shape(w), np.shape(g)
    if g_shape == w_shape or (len(g_shape) == 1 and w_shape[-1:] == g_shape):
        return
    raise ValueError(
        f"Gate shape {g_shape} fits neither the weight shape {w_shape} "
        f"(unstructured) nor its last axis (structured){path_hint}."
    )


def _gated(w: Array, g: Array) -> Array:
    _check_broadcast("", w, g)
    return g  # [out] broadcasts over the leading axes of [..., out]


def apply_gates(
    base: PyTree, state: GateState, *, temperature: float | Array
) -> PyTree:
    """Effective params ``W0 * min(1, 2 * sigmoid(m / T))``.

    Structured gates (shape ``[out]``) are broadcast over all axes of the
    weight but the last. Pure and jit-able; ``base`` is not modified and its
    leaves outside ``state.logits`` are returned as they are.

    Args:
      base: the frozen parameter pytree.
      state: gate logits, a subtree of ``base``.
      temperature: ``T > 0``; may be traced (no recompilation when it decays).

    Returns:
      A pytree with the structure of ``base``; gated leaves keep their dtype.
    """
    values = gate_values(state.logits, temperature=temperature)
    return selection.map_subtree(
        lambda w, g: w * _gated(w, g).astype(w.dtype), base, values
    )


def prune_rule(state: GateState) -> PyTree:
    """The final FFW pruning rule: keep iff ``m >= 0``.

    Logits exactly 0 are kept (``g(0) = 1``).

    Args:
      state: gate logits.

    Returns:
      A bool subtree shaped like ``state.logits``; True means kept.
    """
    return jax.tree.map(lambda m: m >= 0, state.logits)


def apply_pruning(base: PyTree, state: GateState) -> PyTree:
    """Hard-pruned params: ``W0`` where ``m >= 0``, 0 elsewhere (no gate scaling).

    Args:
      base: the frozen parameter pytree.
      state: gate logits, a subtree of ``base`` (structured gates broadcast
        over the weight's leading axes).

    Returns:
      A pytree with the structure and dtypes of ``base``. Pure and jit-able.
    """
    return selection.map_subtree(
        lambda w, k: jnp.where(_gated(w, k), w, jnp.zeros_like(w)),
        base,
        prune_rule(state),
    )


def pruned_fraction(
    state: GateState, *, params: PyTree | None = None
) -> tuple[Array, dict[str, Array]]:
    """Fraction pruned by :func:`prune_rule` (``m < 0``), overall and per leaf.

    Without ``params`` the fractions count gates (channels, for structured
    gates). With ``params`` they count weights: a structured gate of a
    ``[..., out]`` weight stands for ``prod(...)`` weights. Per-leaf fractions
    are the same either way; the overall fraction is weighted differently
    when structured leaves have different fan-ins. The reference reports
    zeros / entries over all gated weights (pass ``params``).

    Args:
      state: gate logits.
      params: optional parameter pytree containing the gated leaves.

    Returns:
      ``(overall, per_leaf)``: a float32 scalar, and ``{path: float32
      scalar}`` keyed by "/"-joined paths. Jit-able.
    """
    flat = selection.flatten(state.logits)
    weights = selection.flatten(params) if params is not None else {}
    per_leaf, pruned_total, total = {}, 0, 0
    for path, m in flat.items():
        n_gates = max(int(np.size(m)), 1)
        per_weight = 1
        if params is not None:
            _check_broadcast(f" at {path!r}", weights[path], m)
            per_weight = int(np.size(weights[path])) // n_gates
        pruned = jnp.sum(m < 0)
        per_leaf[path] = (pruned / n_gates).astype(jnp.float32)
        pruned_total = pruned_total + pruned * per_weight
        total += n_gates * per_weight
    overall = (pruned_total / max(total, 1)).astype(jnp.float32)
    return overall, per_leaf


# -----------------------------------------------------------------------------
# Structured gates that remove whole channels (kernel + followers).
# -----------------------------------------------------------------------------


def _module_of(path: str) -> str:
    return path.rpartition(selection.PATH_SEP)[0]


def default_followers(params: PyTree, kernel_paths: Iterable[str]) -> dict[str, tuple]:
    """Each kernel's own bias as its only follower (Dense/Conv without BN).

    Args:
      params: the parameter pytree.
      kernel_paths: "/"-joined paths of gated kernels.

    Returns:
      ``{kernel_path: ("<module>/bias",)}``, or ``()`` for a kernel whose
      module has no ``bias`` leaf.
    """
    flat = selection.flatten(params)
    out = {}
    for p in kernel_paths:
        module = _module_of(p)
        bias = f"{module}{selection.PATH_SEP}bias" if module else "bias"
        out[p] = (bias,) if bias in flat and bias != p else ()
    return out


def soft_gated_paths(kernel_path: str, followers: Sequence[str]) -> tuple[str, ...]:
    """The parameters a soft structured gate multiplies (module docstring).

    The followers outside the kernel's module (e.g. a following BatchNorm's
    scale and bias) if there are any; otherwise the kernel and its followers
    (its own bias).
    """
    own = _module_of(kernel_path)
    downstream = tuple(f for f in followers if _module_of(f) != own)
    return downstream if downstream else (kernel_path, *followers)


def _structured_plan(
    base: PyTree, state: GateState, followers: Followers | None
) -> tuple[dict[str, Any], dict[str, tuple[str, ...]]]:
    """Checks shapes and returns ``(flat_base, {gated_path: followers})``."""
    flat_base = selection.flatten(base)
    followers = dict(followers or {})
    flat_logits = selection.flatten(state.logits)
    unknown = sorted(set(followers) - set(flat_logits))
    if unknown:
        raise KeyError(f"followers names kernels that have no gate: {unknown[:5]}.")
    plan, owner = {}, {}
    for p, m in flat_logits.items():
        if p not in flat_base:
            raise KeyError(f"Gate path {p!r} is not in the params.")
        _check_broadcast(f" at {p!r}", flat_base[p], m)
        fol = tuple(followers.get(p, ()))
        structured = np.ndim(m) == 1 and np.ndim(flat_base[p]) > 1
        if fol and not structured:
            raise ValueError(
                f"{p!r} has followers but its gate is not per output channel "
                f"(gate shape {np.shape(m)}, weight shape {np.shape(flat_base[p])})."
            )
        for f in fol:
            if f not in flat_base:
                raise KeyError(f"Follower {f!r} of {p!r} is not in the params.")
            if np.shape(flat_base[f]) != np.shape(m):
                raise ValueError(
                    f"Follower {f!r} of {p!r} has shape {np.shape(flat_base[f])}; "
                    f"a per-channel follower must have the gate's shape "
                    f"{np.shape(m)}."
                )
            if f in owner or f in flat_logits:
                other = owner.get(f, f)
                raise ValueError(
                    f"{f!r} follows {p!r} but is also gated by {other!r}; a "
                    "parameter may belong to one gated channel group only."
                )
            owner[f] = p
        plan[p] = fol
    return flat_base, plan


def apply_structured_gates(
    base: PyTree,
    state: GateState,
    *,
    temperature: float | Array,
    followers: Followers | None,
) -> PyTree:
    """Soft structured gating: per-channel gates on a kernel and its followers.

    For every gated kernel with logits ``[out]``, the gate
    ``g = min(1, 2 * sigmoid(m / T))`` multiplies the parameters named by
    :func:`soft_gated_paths` (module docstring): the following BatchNorm's
    scale and bias when the kernel has BN followers, else the kernel's output
    channels and its own bias. Leaves with full-shape (unstructured) logits
    and no followers are gated as in :func:`apply_gates`.

    Args:
      base: the frozen parameter pytree.
      state: gate logits, a subtree of ``base``.
      temperature: ``T > 0``; may be traced.
      followers: ``{kernel_path: (follower_path, ...)}`` of per-channel
        ``[out]`` parameters of ``base`` (a static mapping of strings: close
        over it, do not pass it through ``jax.jit``). A gated kernel missing
        from it has no followers.

    Returns:
      A pytree with the structure and dtypes of ``base``. Pure and jit-able.
    """
    flat_base, plan = _structured_plan(base, state, followers)
    values = selection.flatten(gate_values(state.logits, temperature=temperature))
    new = {}
    for p, fol in plan.items():
        g = values[p]
        targets = soft_gated_paths(p, fol) if fol else (p,)
        for t in targets:
            w = flat_base[t]
            new[t] = w * g.astype(w.dtype)
    return selection.merge(base, selection.unflatten(new))


def pruning_masks(
    base: PyTree, state: GateState, *, followers: Followers | None = None
) -> dict[str, Any]:
    """Full-shape keep masks of the pruning rule ``m >= 0``.

    Args:
      base: the parameter pytree.
      state: gate logits, a subtree of ``base``.
      followers: optional ``{kernel_path: (follower_path, ...)}``; a pruned
        channel is also pruned in each follower.

    Returns:
      A bool subtree of ``base`` (the gated leaves and their followers), each
      mask with its parameter's shape; True means kept. Ready for
      :func:`moddiffy_jax.subnets.diffs.pruning_diff`.
    """
    flat_base, plan = _structured_plan(base, state, followers)
    keep = selection.flatten(prune_rule(state))
    masks = {}
    for p, fol in plan.items():
        masks[p] = jnp.broadcast_to(keep[p], np.shape(flat_base[p]))
        for f in fol:
            masks[f] = keep[p]
    return selection.unflatten(masks)


def apply_structured_pruning(
    base: PyTree, state: GateState, *, followers: Followers | None
) -> PyTree:
    """Hard structured pruning: channels with ``m < 0`` removed entirely.

    Zeroes the pruned output channels of each gated kernel and the same
    entries of every follower (its bias, the following BN's scale and bias);
    kept parameters are the unscaled ``W0``. With eval-mode BN and an
    activation with ``act(0) = 0`` the channel's output is exactly 0.

    Args:
      base: the frozen parameter pytree.
      state: gate logits (``[out]`` per structured kernel).
      followers: ``{kernel_path: (follower_path, ...)}`` (static).

    Returns:
      A pytree with the structure and dtypes of ``base``. Pure and jit-able.
    """
    masks = pruning_masks(base, state, followers=followers)
    return selection.map_subtree(
        lambda w, k: jnp.where(k, w, jnp.zeros_like(w)), base, masks
    )
