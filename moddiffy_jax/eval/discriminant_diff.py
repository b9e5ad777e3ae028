"""The attribute-penalized task discriminant written into weights: a sparse diff.

:mod:`moddiffy_jax.eval.discriminant` projects the core's CLS vectors onto
``k = C - 1`` task directions that, inside each task class, the attributes'
groups share. This module writes that projection into the encoder's last
layer, so that the *encoder with the diff added* produces it and the core's
own task head reads it; the result is a :class:`SparseDiff` like any other,
saved with the core's fingerprint and added with
:func:`moddiffy_jax.subnets.diffs.apply_diffs`.

The CLS vector is ``h = scale * n + bias`` with ``n`` LayerNorm's normalised
coordinates of ``y = x + g W_o + b_o`` (``g`` the last FFN's activations at
CLS). The diff:

1. keeps ``k`` coordinates ``K`` of ``h`` (the rows of the core head's
   class-centred kernel that span most volume) and holds every other one at
   its train mean: ``scale_i -> 0``, ``bias_i -> mean_i`` (as the task
   bottleneck does, :mod:`moddiffy_jax.eval.bottleneck`);
2. sets the kept coordinates to the affine function of the projections ``z``
   under which the core head's centred logits equal the refit discriminant
   head's: ``h_K = (z kernel_d + bias_d - c) pinv(W_c[K])``; their scale and
   bias become that target's train spread and mean, so the target of
   ``n_K`` is standardized;
3. finds, per train row, the values ``u`` of ``y_K`` whose LayerNorm gives
   that ``n_K`` (a fixed point: ``k`` of ``H`` coordinates move, the others'
   mean and spread follow), and reads ``u - y_K`` from ``g`` by ridge
   regression: ``Delta W_o[:, K] = A``, ``Delta b_o[K] = c``.

``2 H + k (I + 1)`` entries (3,842 for MiniLM with three task classes:
0.017% of its encoder). Exact but for the regression: its train R^2 is in
the record; on dwmw17's finetune core (seed 0) 0.965 on train, 0.915 on
test, and the diff's representation reads dialect at 0.781 / 0.808 (linear /
converged MLP) where the projection reads 0.787 / 0.826 (floor 0.794).

The representation keeps only the task (``k`` varying coordinates), so it
removes every attribute the task does not carry; the penalty aims it at the
named ones. Single diffs do not compose by addition (each rewrites the same
LayerNorm); a composition is its own fit of all its attributes together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from moddiffy_jax.methods import erasure_refit
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets.selection import flatten, unflatten

#: The last LayerNorm, relative to the encoder params.
LAYER_NORM = "encoder/layer_{last}/output/LayerNorm/{leaf}"
#: Ridge of the readout, as a share of the activations' mean variance.
L2 = 1e-4
#: Share of LayerNorm's unit mean square the kept coordinates may take.
ROOM = 0.25
#: Most train rows the readout is fit on.
MAX_ROWS = 20_000
#: Fixed-point iterations of the LayerNorm inversion, and its tolerance.
ITERATIONS = 100
TOLERANCE = 1e-6


def paths(num_layers: int) -> dict[str, str]:
    """The four leaves the diff writes: ``scale``, ``bias`` (the last
    LayerNorm), ``kernel``, ``out_bias`` (the last FFN output)."""
    last = num_layers - 1
    kernel, out_bias = erasure_refit.output_paths(num_layers)
    return {
        "scale": LAYER_NORM.format(last=last, leaf="scale"),
        "bias": LAYER_NORM.format(last=last, leaf="bias"),
        "kernel": kernel,
        "out_bias": out_bias,
    }


class NotWritable(ValueError):
    """The model cannot take the discriminant's diff: ``reason`` says why
    (what ``weights="auto"`` reports beside its projection rows), the
    message adds the fix."""

    def __init__(self, reason: str, fix: str):
        super().__init__(f"{reason}. {fix}")
        self.reason = reason


def linear_head(
    logits_of: Callable[[np.ndarray], np.ndarray], width: int, *, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(kernel [H, C], bias [C])`` of a task head that is affine in ``h``;
    a clear error where it is not (a hidden layer)."""
    zero = np.asarray(logits_of(np.zeros((1, width), np.float32)), np.float64)
    eye = np.asarray(logits_of(np.eye(width, dtype=np.float32)), np.float64)
    kernel, bias = eye - zero, zero[0]
    probe = np.random.default_rng(seed).normal(size=(4, width)).astype(np.float32)
    got = np.asarray(logits_of(probe), np.float64)
    want = probe @ kernel + bias
    if not np.allclose(got, want, rtol=1e-3, atol=1e-3 * (1 + np.abs(want).max())):
        raise NotWritable(
            "The discriminant's weight diff keeps the core's task head, which "
            "must be linear in the CLS vector; this head is not (a hidden "
            "layer: config.model.task_hidden > 0)",
            "Set config.eval.discriminant.weights=False (or evaluate "
            "--nodiscriminant_weights) for the projection rows.",
        )
    return kernel, bias


def kept_coordinates(kernel: np.ndarray, k: int) -> np.ndarray:
    """``k`` coordinates (sorted) whose rows of the class-centred head kernel
    span most volume (greedy, each the largest row after removing the span of
    those chosen): the coordinates the head reads the task through."""
    rows = np.asarray(kernel, np.float64)
    rows = rows - rows.mean(1, keepdims=True)
    chosen = []
    for _ in range(k):
        norms = np.sum(rows**2, 1)
        norms[chosen] = -1.0
        i = int(np.argmax(norms))
        if norms[i] <= 1e-12 * max(float(np.sum(kernel**2)), 1e-30):
            raise ValueError(
                f"The core head's kernel spans fewer than {k} class-centred "
                "directions: the diff cannot give its logits the "
                "discriminant's."
            )
        chosen.append(i)
        v = rows[i] / np.linalg.norm(rows[i])
        rows = rows - np.outer(rows @ v, v)
    return np.array(sorted(chosen))


def solve_pre_layernorm(
    y: np.ndarray,
    coordinates: np.ndarray,
    target: np.ndarray,
    eps: float,
    *,
    iterations: int = ITERATIONS,
) -> np.ndarray:
    """Values ``u`` [N, k] of ``y[:, coordinates]`` such that LayerNorm's
    normalised ``y`` (the other coordinates unchanged) equals ``target`` at
    ``coordinates``. The normalised coordinates have unit mean square, so
    ``sum(target**2)`` must stay below ``H`` in every row."""
    y = np.asarray(y, np.float64)
    target = np.asarray(target, np.float64)
    width = y.shape[1]
    if np.max(np.sum(target**2, 1)) >= width:
        raise ValueError(
            "A LayerNorm output has unit mean square: the kept coordinates' "
            f"targets (largest row sum of squares "
            f"{np.max(np.sum(target**2, 1)):.1f}) must stay below the width "
            f"{width}."
        )
    full = y.copy()
    u = full[:, coordinates]
    for _ in range(iterations):
        full[:, coordinates] = u
        mean = full.mean(1, keepdims=True)
        std = np.sqrt(np.mean((full - mean) ** 2, 1, keepdims=True) + eps)
        new = mean + std * target
        step = np.max(np.abs(new - u))
        u = new
        if step <= TOLERANCE * (1.0 + np.max(np.abs(u))):
            break
    return u


@dataclasses.dataclass(frozen=True)
class Written:
    """A discriminant written into weights.

    Attributes:
      diff: the sparse diff (encoder params' paths).
      coordinates: the kept coordinates of the CLS vector.
      record: entries, kept coordinates and the readout's train R^2.
    """

    diff: diffs_lib.SparseDiff
    coordinates: np.ndarray
    record: dict[str, Any]


def write_discriminant(
    fit: Any,
    core_params: Any,
    train_h: np.ndarray,
    y: np.ndarray,
    g: np.ndarray,
    *,
    head_kernel: np.ndarray,
    head_bias: np.ndarray,
    num_layers: int,
    layer_norm_eps: float,
    l2: float = L2,
    name: str = "",
    base_fingerprint: str = "",
) -> Written:
    """The module doc's diff for the fitted discriminant ``fit``
    (:class:`moddiffy_jax.eval.discriminant.Discriminant`) from the core's
    train CLS vectors ``train_h`` [N, H] and their pre-LayerNorm vectors ``y``
    [N, H] and last FFN activations ``g`` [N, I] (same rows)."""
    where = paths(num_layers)
    flat = flatten(core_params)
    missing = [p for p in where.values() if p not in flat]
    if missing:
        raise ValueError(
            f"The discriminant's weight diff writes into {missing}, which these "
            "params do not have (a post-LN BERT encoder's last layer)."
        )
    scale = np.asarray(flat[where["scale"]], np.float64)
    ln_bias = np.asarray(flat[where["bias"]], np.float64)
    kernel = np.asarray(head_kernel, np.float64)
    centred = kernel - kernel.mean(1, keepdims=True)
    bias = np.asarray(head_bias, np.float64)
    bias = bias - bias.mean()
    k = fit.k
    coords = kept_coordinates(kernel, k)
    rest = np.setdiff1d(np.arange(kernel.shape[0]), coords)
    fill = np.asarray(train_h, np.float64).mean(0)
    # The kept coordinates' values that give the core head the discriminant's
    # centred logits (the held ones and the bias fixed).
    z = np.asarray(fit.apply(train_h), np.float64)
    logits = z @ fit.kernel + fit.bias
    logits -= logits.mean(1, keepdims=True)
    const = fill[rest] @ centred[rest] + bias
    kept = (logits - const) @ np.linalg.pinv(centred[coords])
    new_bias = kept.mean(0)
    new_scale = np.maximum(kept.std(0), 1e-12)
    # LayerNorm's output has unit mean square: where a train row's kept
    # coordinates would need more than a quarter of it, the scale grows
    # instead (the CLS targets are unchanged).
    room = np.sqrt(
        np.max(np.sum(((kept - new_bias) / new_scale) ** 2, 1)) / (ROOM * len(scale))
    )
    new_scale = new_scale * max(1.0, float(room))
    target = (kept - new_bias) / new_scale
    u = solve_pre_layernorm(y, coords, target, layer_norm_eps)
    change = u - np.asarray(y, np.float64)[:, coords]
    a, c = erasure_refit.fit_readout(g, change, l2=l2)
    r2 = erasure_refit.r_squared(np.asarray(g, np.float64) @ a + c, change)
    # Deltas.
    d_scale = -scale.copy()
    d_scale[coords] = new_scale - scale[coords]
    d_bias = fill - ln_bias
    d_bias[coords] = new_bias - ln_bias[coords]
    w_o = flat[where["kernel"]]
    d_kernel = np.zeros(w_o.shape, np.float64)
    d_kernel[:, coords] = a
    d_out = np.zeros(flat[where["out_bias"]].shape, np.float64)
    d_out[coords] = c
    dtype = np.asarray(w_o).dtype
    dense = {
        where["scale"]: d_scale,
        where["bias"]: d_bias,
        where["kernel"]: d_kernel,
        where["out_bias"]: d_out,
    }
    record = {
        "kept_coordinates": coords.tolist(),
        "readout_r2": r2,
        "fit_rows": int(len(y)),
        "l2": float(l2),
    }
    sd = diffs_lib.SparseDiff.from_dense(
        unflatten({p: v.astype(dtype) for p, v in dense.items()}),
        name=name,
        base_fingerprint=base_fingerprint,
        rules=list(dense),
        info={
            "method": "discriminant",
            "compose": "alone",
            "penalty": float(fit.penalty),
            **record,
        },
    )
    record["entries"] = int(sd.nnz())
    return Written(diff=sd, coordinates=coords, record=record)


def problem(model: Any) -> str | None:
    """Why the diff cannot be written into ``model``, or None (it needs a
    post-LN BERT text encoder whose last layer is not scanned or adapted;
    the task head's linearity is checked when writing)."""
    cfg = getattr(model, "bert_config", None)
    written = erasure_refit.output_paths(cfg.num_hidden_layers) if cfg else ()
    why = erasure_refit.problem(model, written)
    # The same constraints as the eraser's (the same layer is written).
    return why.replace("the eraser", "the diff") if why else None


def writer_or_reason(
    ctx: Any, rep: Any, head: Any, core_params: Any, core_reps, parts=None
):
    """``(Writer, None)`` where the diff can be written, else ``(None, why)``."""
    why = problem(ctx.model)
    if why:
        return None, why
    try:
        return Writer(ctx, rep, head, core_params, core_reps, parts=parts), None
    except NotWritable as e:  # the reason, without the fix for weights=True
        return None, e.reason
    except ValueError as e:
        return None, str(e)


class Writer:
    """Writes discriminants fitted on one core into diffs of it, and reads
    the core with a diff added (``rep``: the run's
    :class:`~moddiffy_jax.eval.forward.Representer`; ``core_reps``: the
    core's CLS vectors by split, train among them). The readout is fit on
    at most ``max_rows`` train rows (a seeded sample of a larger split: the
    activations are ``[rows, intermediate size]``).

    ``parts``: the core's last-layer parts by split (``split -> (x, g)``,
    :func:`core_parts`) for every split of ``core_reps``. With them the fit
    reads no encoder pass and a diff's representations are closed form
    (the diff changes only the last FFN output and LayerNorm: the module
    doc's ``h = LN(x + g W_o + b_o)``); without, the train split is
    encoded for the fit and every split again with each diff added."""

    def __init__(
        self,
        ctx: Any,
        rep: Any,
        head: Any,
        core_params: Any,
        core_reps,
        *,
        max_rows: int = MAX_ROWS,
        seed: int = 0,
        parts: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ):
        model = ctx.model
        why = problem(model)
        if why:
            raise ValueError(
                f"The discriminant's weight diff cannot be written: {why}. Set "
                "config.eval.discriminant.weights='auto' or False (evaluate "
                "--nodiscriminant_weights) for the projection rows."
            )
        self.rep, self.head, self.core = rep, head, core_params
        self.core_reps = core_reps
        self.config = model.bert_config
        self.kernel, self.bias = linear_head(
            lambda h: rep.head(head, h), self.config.hidden_size
        )
        from moddiffy_jax.data.dataset import subset_split

        split = ctx.data.splits["train"]
        rows = np.arange(len(split.task))
        if len(rows) > max_rows:
            rows = np.sort(
                np.random.default_rng(seed).choice(len(rows), max_rows, replace=False)
            )
            split = subset_split(split, rows)
        self.rows = rows
        last = self.config.num_hidden_layers - 1
        self.parts = None
        if parts is not None and all(s in parts for s in core_reps):
            self.parts = {s: parts[s] for s in core_reps}
            x, g = (np.asarray(a)[rows] for a in parts["train"])
            self.y = np.asarray(erasure_refit.pre_layernorm(core_params, x, g, last))
            self.g = g
            self._last = erasure_refit.last_output_fn(model)
        else:
            fn = erasure_refit.feature_fn(model)
            self.y, self.g = erasure_refit.features(fn, rep, core_params, split)

    def write(self, fit: Any, name: str, base_fingerprint: str) -> Written:
        return write_discriminant(
            fit,
            self.core,
            np.asarray(self.core_reps["train"])[self.rows],
            self.y,
            self.g,
            head_kernel=self.kernel,
            head_bias=self.bias,
            num_layers=self.config.num_hidden_layers,
            layer_norm_eps=self.config.layer_norm_eps,
            name=name,
            base_fingerprint=base_fingerprint,
        )

    def represent(self, diff: diffs_lib.SparseDiff) -> dict[str, np.ndarray]:
        """The CLS vectors of every split of ``core_reps`` with ``diff`` added."""
        params = diffs_lib.apply_diffs(self.core, [diff])
        if self.parts is not None:
            return {
                s: np.asarray(self._last(params, x, g))
                for s, (x, g) in self.parts.items()
            }
        return {s: self.rep.represent(params, s) for s in self.core_reps}

    def predict(self, h: np.ndarray) -> np.ndarray:
        """The core head's predictions."""
        return np.asarray(self.rep.predict(self.head, h))


def core_parts(
    rep: Any, params: Any, split: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(h, x, g)`` of every row of ``split``: the CLS vectors and the
    last layer's parts :class:`Writer` reads (``rep``: a
    :class:`~moddiffy_jax.eval.forward.Forward` for the batches; one
    encoder pass, the last layer at CLS alone)."""
    fn = _parts_fn(rep.model)
    out: list[list[np.ndarray]] = [[], [], []]
    for inputs, real in rep.batches(split):
        for acc, a in zip(out, fn(params, inputs), strict=True):
            acc.append(np.asarray(a)[real])
    h, x, g = (np.concatenate(a) for a in out)
    return h, x, g


_PARTS_FNS: dict[int, tuple[Any, Any]] = {}
#: The parts functions kept at once (the latest models'): a notebook that
#: builds many models does not keep every one of them alive.
_PARTS_KEPT = 4


def _parts_fn(model: Any):
    """One jitted parts function per model object (the export's table and
    the report read the same model), for the last few models only."""
    key = id(model)
    if key not in _PARTS_FNS or _PARTS_FNS[key][0] is not model:
        _PARTS_FNS[key] = (model, erasure_refit.cls_parts_fn(model))
    _PARTS_FNS[key] = _PARTS_FNS.pop(key)  # the most recent last
    while len(_PARTS_FNS) > _PARTS_KEPT:
        del _PARTS_FNS[next(iter(_PARTS_FNS))]
    return _PARTS_FNS[key][1]


def wants_parts(model: Any, options: Mapping[str, Any] | None) -> bool:
    """Whether the run's report writes discriminant diffs into ``model``
    (``options``: ``config.eval.discriminant`` as ``evaluate_run`` takes
    it, None when off), so the core's encoding should keep its parts."""
    if options is None or not options.get("weights", False):
        return False
    return problem(model) is None


def encode_core(
    rep: Any,
    params: Any,
    splits: Mapping[str, Any],
    known_reps: Mapping[str, np.ndarray],
    known_parts: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The core's representations and parts of each split in ``splits``
    (name -> split object): known ones are kept (parts only where the
    split's representations are known too, with its row count), the others
    read in one parts pass per split (:func:`core_parts`)."""
    reps, parts = {}, {}
    for s, split in splits.items():
        h, known = known_reps.get(s), known_parts.get(s)
        if h is not None and known is not None:
            if all(np.shape(a)[0] == len(split) for a in known):
                reps[s], parts[s] = np.asarray(h), tuple(known)
                continue
        fresh, x, g = core_parts(rep, params, split)
        reps[s] = fresh if h is None else np.asarray(h)
        parts[s] = (x, g)
    return reps, parts
