"""Closed-form erasure, folded into each attribute's diff when training ends.

What a trained diff leaves of its attribute is, on dwmw17's dialect, mostly
linear and in few directions (docs/efficacy.md, stop 54: erasing one
direction of the core's CLS vectors takes a fresh linear probe from 0.953 to
0.795, floor 0.794). LEACE (Belrose et al. 2023) erases such information
from *vectors* in closed form; a diff can only change *weights*. This module
writes a LEACE-style oblique projection into the weights of the last layer's
FFN output, where it is exact up to one linear regression.

The representation is ``h = LN(y)``, ``y = x + g W_o + b_o`` (``g`` the last
layer's FFN activations at the CLS token, ``x`` its residual input). In
LayerNorm's normalised coordinates ``n = (y - mean(y)) / std(y)`` the eraser
is ``n' = n - (n - m) R U^T``:

* ``D`` [H, r]: the attribute's mean offsets *within* each task class
  (pooled over the task classes, count-weighted), ``r = C - 1`` for ``C``
  attribute values; ``S`` the pooled within-class covariance of ``n``;
* ``R = S^-1 D`` (the within-class Fisher directions: what a linear probe
  reads) and ``U = D (D^T S^-1 D)^-1`` (so ``R^T U = I``): after the
  eraser the attribute's offsets within each task class are zero on the fit
  rows, LEACE's condition, restricted to differences within a task class so
  that the task's own separation is kept.

``U`` is centred (offsets of centred vectors), so ``y' = y - s U^T`` with
``s = std(y) (n - m) R`` gives ``n'`` up to the change of ``std(y)``. The
last layer's FFN activations already hold ``s`` almost linearly (ridge R^2
0.97 from 300 of MiniLM's 1,536 units on dwmw17), so with ``s ~ g_k A + c``
read from ``k`` units::

    Delta W_o[units, :] = -A U^T      Delta b_o = -c U^T

a rank ``r`` edit of ``k`` rows of one matrix, ``(k + 1) H`` entries. It is
added to the trained diff, whose other entries are trimmed by magnitude so
that the diff keeps its exact budget (``diff.erasure_share`` of it goes to
the eraser). Fit on the training split with the trained diff added; nothing
is differentiated, so a resumed run refits to the same diff.

Limits, measured (docs/efficacy.md, stop 55): the removal is linear (a
converged MLP still reads most of it); on diffs trained with
counterfactual swaps it overshoots the floor (``diff.erasure="auto"``
leaves those as trained); erasers fitted for single diffs do not remove
when the diffs are composed (:mod:`moddiffy_jax.methods.joint_erasure`
fits them again on each composition); where the CLS vectors nearly share one
direction (the tiny test BERT) LayerNorm's renormalisation puts back what
the eraser took out.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import sparse_diff

#: The last layer's FFN output, relative to the encoder params.
KERNEL = "encoder/layer_{last}/output/dense/kernel"
BIAS = "encoder/layer_{last}/output/dense/bias"


def output_paths(num_layers: int) -> tuple[str, str]:
    """The kernel and bias paths the eraser writes into."""
    last = num_layers - 1
    return KERNEL.format(last=last), BIAS.format(last=last)


def problem(model: Any, rules_paths: Any, word_rows: int = 0) -> str | None:
    """Why the eraser cannot be written here, or None: it needs a BERT text
    model (post-LN, no adapter, layers not scanned) whose diffs may touch
    the last layer's FFN output."""
    cfg = getattr(model, "bert_config", None)
    if cfg is None:
        return (
            "the eraser is written into a BERT encoder's last layer; this model "
            f"({type(model).__name__}) has none"
        )
    if cfg.adapter_reduction_factor:
        return "the eraser reads the last layer's FFN output, which an adapter changes"
    if getattr(model.encoder, "scan_layers", False):
        return (
            "the eraser reads the last layer's activations, which a scanned "
            "layer stack does not expose (config.model.scan_layers=False does)"
        )
    if word_rows:
        return "config.diff.word_rows keeps the diffs to word-embedding rows"
    missing = [p for p in output_paths(cfg.num_hidden_layers) if p not in rules_paths]
    if missing:
        return (
            f"the eraser writes into {missing}, which the diff's rules "
            "(config.diff.include / exclude) leave out"
        )
    return None


def check_model(model: Any, rules_paths: Any, word_rows: int = 0) -> None:
    """A clear error where :func:`problem` finds one."""
    why = problem(model, rules_paths, word_rows)
    if why:
        raise ValueError(
            f"config.diff.erasure='on': {why}. Set config.diff.erasure='auto' "
            "(the eraser where it can be written) or 'off'."
        )


# --------------------------------------------------------------------------
# Features: the last layer's CLS pre-LayerNorm vector and FFN activations.


def cls_parts_fn(model: Any):
    """A jitted ``(params, inputs) -> (h [B, H], x [B, H], g [B, I])`` at
    the CLS token: the representation, the last layer's attention output
    (its FFN output's residual) and its FFN activations. The last layer
    computes the CLS position alone, as ``TextModel.represent`` does, so
    ``h`` is the representation that pass gives (to rounding) and the
    parts cost nothing more. With them, the representation of the same
    encoder with only its last FFN output and LayerNorm changed is closed
    form (:func:`last_output_fn`)."""
    last = model.bert_config.num_hidden_layers - 1
    wanted = {(f"layer_{last}", "attention"), (f"layer_{last}", "intermediate")}

    def pick(module, method_name):
        return method_name == "__call__" and tuple(module.scope.path[-2:]) in wanted

    def fn(params, inputs):
        out, state = model.encoder.apply(
            {"params": params},
            inputs["input_ids"],
            inputs["attention_mask"],
            inputs.get("token_type_ids"),
            deterministic=True,
            cls_only=True,
            capture_intermediates=pick,
            mutable=["intermediates"],
        )
        layer = state["intermediates"]["encoder"][f"layer_{last}"]
        x = layer["attention"]["__call__"][0][:, 0].astype(jnp.float32)
        g = layer["intermediate"]["__call__"][0][:, 0].astype(jnp.float32)
        return out.last_hidden_state[:, 0].astype(jnp.float32), x, g

    return jax.jit(fn)


def last_output_fn(model: Any):
    """A jitted ``(params, x, g) -> h [N, H]``: the CLS representation from
    :func:`cls_parts_fn`'s ``x`` and ``g`` through the last layer's FFN
    output and LayerNorm of ``params`` (the model's own module, so the same
    arithmetic as the encoder's pass)."""
    from moddiffy_jax.models import bert_model

    cfg = model.bert_config
    last = cfg.num_hidden_layers - 1
    module = bert_model._DenseDropoutLayerNorm(
        config=cfg, dtype=model.encoder.dtype, param_dtype=model.encoder.param_dtype
    )

    def fn(params, x, g):
        p = params["encoder"][f"layer_{last}"]["output"]
        h = module.apply({"params": p}, g, x, deterministic=True)
        return h.astype(jnp.float32)

    return jax.jit(fn)


def feature_fn(model: Any):
    """A jitted ``(params, inputs) -> (y [B, H], g [B, I])`` at the CLS token
    (``y``: the last LayerNorm's input)."""
    parts = cls_parts_fn(model)
    last = model.bert_config.num_hidden_layers - 1

    def fn(params, inputs):
        _, x, g = parts(params, inputs)
        return pre_layernorm(params, x, g, last), g

    return jax.jit(fn)


def pre_layernorm(params: Any, x: Any, g: Any, last: int) -> Any:
    """``y = x + g W_o + b_o`` (float32) from :func:`cls_parts_fn`'s parts."""
    out = params["encoder"][f"layer_{last}"]["output"]["dense"]
    return x + g @ out["kernel"].astype(jnp.float32) + out["bias"]


def features(
    fn, forward: Any, params: Any, split: Any
) -> tuple[np.ndarray, np.ndarray]:
    """``(y, g)`` of every row of ``split`` (``forward``: an
    :class:`moddiffy_jax.eval.forward.Forward` for its batches)."""
    ys, gs = [], []
    for inputs, real in forward.batches(split):
        y, g = fn(params, inputs)
        ys.append(np.asarray(y)[real])
        gs.append(np.asarray(g)[real])
    return np.concatenate(ys), np.concatenate(gs)


# --------------------------------------------------------------------------
# The fit (numpy, float64).


def normalised(y: np.ndarray, eps: float = 1e-12) -> tuple[np.ndarray, np.ndarray]:
    """LayerNorm without its affine part: ``(n [N, H], std [N])``."""
    y = np.asarray(y, np.float64)
    centred = y - y.mean(-1, keepdims=True)
    std = np.sqrt(np.mean(centred**2, -1) + eps)
    return centred / std[:, None], std


@dataclasses.dataclass(frozen=True)
class Eraser:
    """``n' = n - (n - mean) read write^T`` in normalised coordinates."""

    read: np.ndarray  # [H, r]
    write: np.ndarray  # [H, r]
    mean: np.ndarray  # [H]
    separation: float  # sqrt(tr(D^T S^-1 D)) on the fit rows, before

    def coordinates(self, y: np.ndarray) -> np.ndarray:
        """``s`` [N, r]: what ``y`` must lose along ``write`` (in y's scale)."""
        n, std = normalised(y)
        return ((n - self.mean) @ self.read) * std[:, None]


def fit_eraser(
    y: np.ndarray,
    task: np.ndarray,
    labels: np.ndarray,
    *,
    ridge: float = 1e-3,
) -> Eraser:
    """The eraser of one attribute from pre-LN vectors ``y`` [N, H], task
    labels and attribute labels (rows with a negative label are left out).

    ``ridge`` is added to the within-class covariance's diagonal as a share
    of its mean variance (the normalised vectors are singular along the
    all-ones direction, and the least-variance directions are noise).
    """
    rows = np.asarray(labels) >= 0
    n, _ = normalised(np.asarray(y)[rows])
    task, labels = np.asarray(task)[rows], np.asarray(labels)[rows]
    values = np.unique(labels)
    if len(values) < 2:
        raise ValueError(
            f"the erasure refit needs at least two attribute values among its "
            f"fit rows; got {values.tolist()}."
        )
    dim = n.shape[1]
    scatter = np.zeros((dim, dim))
    offsets = np.zeros((len(values), dim))
    counts = np.zeros(len(values))
    for t in np.unique(task):
        member = task == t
        centre = n[member].mean(0)
        dev = n[member] - centre
        scatter += dev.T @ dev
        for j, v in enumerate(values):
            cell = member & (labels == v)
            if cell.any():
                offsets[j] += cell.sum() * (n[cell].mean(0) - centre)
                counts[j] += cell.sum()
    cov = scatter / len(n)
    offsets /= np.maximum(counts, 1.0)[:, None]
    # The offsets sum to 0 weighted by counts: r = C - 1 directions at most.
    u, s, _ = np.linalg.svd(offsets.T, full_matrices=False)
    d = u[:, s > 1e-6 * max(s.max(), 1e-30)][:, : len(values) - 1]
    reg = cov + ridge * np.trace(cov) / dim * np.eye(dim)
    read = np.linalg.solve(reg, d)
    gram = d.T @ read
    write = d @ np.linalg.inv(gram)
    # The separation before: the whitened norm of the offsets' span.
    sep = float(np.sqrt(max(np.trace(offsets @ np.linalg.solve(reg, offsets.T)), 0.0)))
    return Eraser(read=read, write=write, mean=n.mean(0), separation=sep)


def fit_readout(
    g: np.ndarray, target: np.ndarray, *, l2: float = 1e-4
) -> tuple[np.ndarray, np.ndarray]:
    """Ridge ``target ~ g A + c``: ``(A [I, r], c [r])``; ``l2`` as a share
    of the mean variance of ``g``'s columns."""
    g = np.asarray(g, np.float64)
    gm, tm = g.mean(0), target.mean(0)
    x = g - gm
    gram = x.T @ x
    gram += l2 * np.trace(gram) / len(gram) * np.eye(len(gram))
    a = np.linalg.solve(gram, x.T @ (target - tm))
    return a, tm - gm @ a


def choose_units(g: np.ndarray, target: np.ndarray, k: int, *, l2: float = 1e-4):
    """The ``k`` FFN units that carry most of the readout (norm of their
    coefficients times their spread), sorted."""
    a, _ = fit_readout(g, target, l2=l2)
    score = np.linalg.norm(a, axis=1) * np.asarray(g).std(0)
    return np.sort(np.argsort(-score, kind="stable")[:k])


def r_squared(pred: np.ndarray, target: np.ndarray) -> float:
    return float(
        1.0
        - np.sum((pred - target) ** 2)
        / max(np.sum((target - target.mean(0)) ** 2), 1e-30)
    )


# --------------------------------------------------------------------------
# The diff: trim to make room, then add the eraser's entries.


def budget_of(sd: diffs_lib.SparseDiff, keep: float | int) -> int:
    """The diff's exact budget, as the cut to fixmask counts it."""
    total = sum(int(np.prod(shape)) for _, shape in sd.shapes)
    return sparse_diff.resolve_keep(keep, total, "the diff's leaves")


def eraser_units(budget: int, share: float, hidden: int) -> int:
    """How many FFN rows ``share`` of ``budget`` buys (``(k + 1) H`` entries)."""
    return int(share * budget) // hidden - 1


def support(units: np.ndarray, hidden: int, kernel: str, bias: str) -> dict:
    """The flat indices the eraser writes: ``units`` rows of the kernel, all
    of the bias."""
    rows = (units[:, None] * hidden + np.arange(hidden)[None]).reshape(-1)
    return {kernel: rows.astype(np.int64), bias: np.arange(hidden, dtype=np.int64)}


def trim(sd: diffs_lib.SparseDiff, room: dict, budget: int) -> diffs_lib.SparseDiff:
    """``sd`` with its entries inside ``room`` (path -> flat indices) kept
    and, outside it, only the largest in magnitude that fit in ``budget``
    minus the room's size (ties to the earlier leaf, then the lower index)."""
    reserved = sum(len(v) for v in room.values())
    paths = list(sd.indices)
    inside, mags, leaf, flat = {}, [], [], []
    for order, path in enumerate(paths):
        idx = np.asarray(sd.indices[path], np.int64)
        inside[path] = np.isin(idx, room.get(path, np.zeros(0, np.int64)))
        free = ~inside[path]
        mags.append(np.abs(np.asarray(sd.values[path], np.float64))[free])
        leaf.append(np.full(int(free.sum()), order))
        flat.append(idx[free])
    mags, leaf, flat = map(np.concatenate, (mags, leaf, flat))
    best = np.lexsort((flat, leaf, -mags))[: max(budget - reserved, 0)]
    indices, values = {}, {}
    for order, path in enumerate(paths):
        idx = np.asarray(sd.indices[path], np.int64)
        chosen = flat[best][leaf[best] == order]
        mask = inside[path] | np.isin(idx, chosen)
        indices[path] = np.asarray(idx[mask], np.int32)
        values[path] = np.asarray(sd.values[path])[mask]
    return dataclasses.replace(sd, indices=indices, values=values)


def add_entries(sd: diffs_lib.SparseDiff, additions: dict) -> diffs_lib.SparseDiff:
    """``sd`` plus ``additions`` (path -> (flat indices, values)); entries in
    both add up; every path's indices stay sorted."""
    indices, values = dict(sd.indices), dict(sd.values)
    dtype = np.dtype(sd.dtype)
    for path, (idx, val) in additions.items():
        old_i = np.asarray(indices[path], np.int64)
        old_v = np.asarray(values[path], np.float64)
        union = np.union1d(old_i, idx)
        total = np.zeros(len(union))
        total[np.searchsorted(union, old_i)] += old_v
        total[np.searchsorted(union, idx)] += val
        indices[path] = union.astype(np.int32)
        values[path] = total.astype(dtype)
    return dataclasses.replace(sd, indices=indices, values=values)


@dataclasses.dataclass(frozen=True)
class Settings:
    share: float = 0.5
    ridge: float = 1e-3
    examples: int = 20000
    seed: int = 0
    rounds: int = 1


def summed(a: dict, b: dict) -> dict:
    """Two erasers' additions in the same rows, added."""
    out = dict(a)
    for path, (idx, val) in b.items():
        if path in out:
            if not np.array_equal(out[path][0], idx):
                raise ValueError(f"the erasers' rows differ at {path!r}")
            out[path] = (idx, np.asarray(out[path][1]) + np.asarray(val))
        else:
            out[path] = (idx, val)
    return out


def fit_split(ctx: Any, settings: Settings) -> Any:
    """The training rows an eraser is fit on (a seeded sample of
    ``settings.examples`` where the split is larger)."""
    from moddiffy_jax.data.dataset import subset_split

    split = ctx.data.splits["train"]
    n_rows = len(split.task)
    if n_rows > settings.examples:
        pick = np.random.default_rng(settings.seed).choice(
            n_rows, settings.examples, replace=False
        )
        split = subset_split(split, np.sort(pick))
    return split


def write_eraser(
    y: np.ndarray,
    g: np.ndarray,
    task: np.ndarray,
    labels: np.ndarray,
    units: np.ndarray,
    paths: tuple[str, str],
    ridge: float,
) -> tuple[dict, dict]:
    """The eraser of ``labels`` fit on features ``(y, g)``, written into
    ``units`` rows of the kernel and the bias (``paths``): ``(additions,
    record)``, additions as ``path -> (flat indices, values)``."""
    kernel, bias = paths
    hidden = y.shape[1]
    room = support(units, hidden, kernel, bias)
    eraser = fit_eraser(y, task, labels, ridge=ridge)
    target = eraser.coordinates(y)
    a, c = fit_readout(g[:, units], target)
    additions = {
        kernel: (room[kernel], -(a @ eraser.write.T).reshape(-1)),
        bias: (room[bias], -(c @ eraser.write.T)),
    }
    record = {
        "readout_r2": r_squared(g[:, units] @ a + c, target),
        "separation_before": eraser.separation,
        "rank": int(eraser.write.shape[1]),
    }
    return additions, record


@dataclasses.dataclass(frozen=True)
class Refit:
    """A diff with its eraser folded in, what the eraser added and where."""

    diff: diffs_lib.SparseDiff
    record: dict
    units: np.ndarray
    additions: dict  # path -> (flat indices, values)


def refit(
    ctx: Any,
    core: Any,
    sd: diffs_lib.SparseDiff,
    attribute: str,
    settings: Settings,
    compose: Any,
    forward: Any,
) -> Refit:
    """The attribute's diff with the eraser folded in, and a record.

    ``compose(core, sd) -> params``; ``forward`` gives the split's batches.
    """
    bert = ctx.model.bert_config
    hidden = bert.hidden_size
    paths = output_paths(bert.num_hidden_layers)
    budget = budget_of(sd, ctx.config.diff.keep)
    k = min(eraser_units(budget, settings.share, hidden), bert.intermediate_size)
    if k < 1:
        raise ValueError(
            f"config.diff.erasure_share={settings.share} of the {attribute!r} "
            f"diff's budget ({budget} entries) buys no row of {paths[0]} "
            f"({hidden} entries each, plus the bias): raise diff.keep or the "
            "share, or set diff.erasure='off'."
        )
    split = fit_split(ctx, settings)
    task, labels = np.asarray(split.task), np.asarray(split.attrs[attribute])
    fn = feature_fn(ctx.model)
    # 1. Which units: from the trained diff as it is.
    y, g = features(fn, forward, compose(core, sd), split)
    first = fit_eraser(y, task, labels, ridge=settings.ridge)
    units = choose_units(g, first.coordinates(y), k)
    # 2. Make room, refit on the trimmed diff's features.
    room = support(units, hidden, *paths)
    before = sd.nnz()
    sd = trim(sd, room, budget)
    if sd.nnz() != before:  # trim only drops entries: none dropped, same model
        y, g = features(fn, forward, compose(core, sd), split)
    additions, fit = write_eraser(y, g, task, labels, units, paths, settings.ridge)
    sd = add_entries(sd, additions)
    # Further rounds in the same rows: each fit again on the erased model
    # (what LayerNorm's renormalisation and the readout left).
    left = []
    for _ in range(settings.rounds - 1):
        y, g = features(fn, forward, compose(core, sd), split)
        more, again = write_eraser(y, g, task, labels, units, paths, settings.ridge)
        sd = add_entries(sd, more)
        additions = summed(additions, more)
        left.append(again["separation_before"])
    if left:
        fit["separation_per_round"] = left
    info = json.loads(sd.info_json or "{}")
    info["erasure"] = {
        "units": int(k),
        "share": settings.share,
        "ridge": settings.ridge,
        "rounds": settings.rounds,
    }
    sd = dataclasses.replace(sd, info_json=json.dumps(info, sort_keys=True))
    record = {
        "units": int(k),
        "entries": int(sum(len(v) for v in room.values())),
        "trained_entries_before": int(before),
        "nnz": int(sd.nnz()),
        "budget": int(budget),
        "fit_rows": int(len(task)),
        **fit,
    }
    return Refit(diff=sd, record=record, units=units, additions=additions)
