"""Two reference rows that say what keeping only the task leaks.

The floor (:func:`moddiffy_jax.eval.removal.leakage_floor`) is what the gold
task label alone gives. Between it and the core's leakage sit two other
readings that every debiasing result should be read beside:

* **the core's decision** (:func:`decision_reps`): the representation
  replaced by the core head's logits, centred (the softmax reads nothing
  else). A probe of them reads what the core's
  own task decision carries of an attribute beyond the gold label: the
  share of the gap that a diff keeping the core's decisions cannot close
  without changing them.
* **a task bottleneck** (:func:`fit_bottleneck`): the representation cut to
  the few coordinates a linear task readout needs most, every other
  coordinate held at its train mean, read by a linear head refit on train.
  The smallest number of coordinates whose dev accuracy is within
  ``max_drop`` of the core head's is kept. It removes every attribute at
  once (it keeps nothing but the task), so it is a baseline that a
  debiasing diff should beat at its task cost, not a debiasing method of
  one attribute.

The bottleneck is a weight diff, not only a transform of vectors: the CLS
vector is the last LayerNorm's output ``scale * n + bias``, so holding
coordinate ``i`` at ``c_i`` is ``scale_i -> 0``, ``bias_i -> c_i``
(:func:`layernorm_delta`; ``2 (H - k)`` entries) plus a refit task head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.eval import linear_probes

#: Default dev-accuracy slack of the bottleneck, in points (as
#: ``eval.token_merge.max_drop``).
MAX_DROP = 0.5


@dataclasses.dataclass(frozen=True)
class BottleneckFit:
    """A task bottleneck fitted on train and chosen on dev.

    Attributes:
      coordinates: sorted indices of the kept coordinates ``[k]``.
      fill: ``[H]`` the value each dropped coordinate is held at (its train
        mean; the kept ones' entries are unused).
      kernel: ``[H, C]`` the refit linear task head (zero rows outside
        ``coordinates``), in the raw coordinates.
      bias: ``[C]``.
      dev_accuracy: the refit head's dev accuracy at ``k``.
      reference_dev_accuracy: the core head's dev accuracy it was held to.
      curve: ``[{"k", "dev_accuracy"}]`` for every size read.
    """

    coordinates: np.ndarray
    fill: np.ndarray
    kernel: np.ndarray
    bias: np.ndarray
    dev_accuracy: float
    reference_dev_accuracy: float
    curve: tuple[dict[str, float], ...]

    @property
    def k(self) -> int:
        return int(len(self.coordinates))

    def apply(self, h: np.ndarray) -> np.ndarray:
        """``h`` [N, H] with every dropped coordinate held at its fill."""
        h = np.asarray(h, np.float32)
        if h.ndim != 2 or h.shape[1] != self.fill.shape[0]:
            raise ValueError(
                f"The bottleneck was fitted on width {self.fill.shape[0]}; got "
                f"representations of shape {h.shape}."
            )
        out = np.broadcast_to(self.fill, h.shape).copy()
        out[:, self.coordinates] = h[:, self.coordinates]
        return out

    def predict(self, h: np.ndarray) -> np.ndarray:
        """Task predictions of the refit head on ``apply(h)`` (or on ``h``:
        the dropped coordinates' rows of the kernel are zero)."""
        return np.argmax(np.asarray(h, np.float32) @ self.kernel + self.bias, -1)

    def summary(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "coordinates": [int(i) for i in self.coordinates],
            "dev_accuracy": self.dev_accuracy,
            "reference_dev_accuracy": self.reference_dev_accuracy,
            "curve": [dict(c) for c in self.curve],
        }


def coordinate_order(logits_of: Callable, train_h) -> np.ndarray:
    """Coordinates by how much the core head reads them (most first).

    A coordinate's need is its train spread times the root mean square,
    over train examples and classes, of the logits' derivative in it: for a
    linear head ``|W_i| std(h_i)``, each coordinate's share of the logits'
    spread; for a deeper head the same to first order. Ties keep the lower
    index. (A logistic regression refit on the standardized vectors ranks
    worse: its kernel spreads over correlated coordinates; docs/efficacy.md,
    stop 58.)
    """
    train_h = jnp.asarray(train_h, jnp.float32)

    def class_sum(h, c):
        return jnp.sum(logits_of(h)[:, c])

    num_classes = int(np.shape(logits_of(train_h[:1]))[-1])
    sq = sum(
        np.square(np.asarray(jax.grad(class_sum)(train_h, c)))
        for c in range(num_classes)
    )
    need = np.sqrt(sq.mean(0)) * np.asarray(train_h).std(0)
    return np.argsort(-need, kind="stable")


def _sizes(width: int) -> list[int]:
    sizes, k = [], 1
    while k < width:
        sizes.append(k)
        k *= 2
    return sizes + [width]


def fit_bottleneck(
    logits_of: Callable,
    train_h,
    train_task,
    dev_h,
    dev_task,
    *,
    num_classes: int,
    reference_dev_accuracy: float,
    max_drop: float = MAX_DROP,
    sizes: Sequence[int] | None = None,
) -> BottleneckFit:
    """The smallest task bottleneck within ``max_drop`` of the core on dev.

    Args:
      logits_of: the core head, ``h [N, H] -> logits [N, C]`` (jax
        traceable); it orders the coordinates (:func:`coordinate_order`).
      train_h, train_task: ``[N, H]`` core representations and gold task
        labels of the train split (the head is refit on them).
      dev_h, dev_task: the same for dev (the size is chosen on them).
      num_classes: task classes ``C``.
      reference_dev_accuracy: the core head's dev accuracy.
      max_drop: the dev accuracy the bottleneck may give up, in points
        (0.5: half a point).
      sizes: the numbers of coordinates to read, ascending (default 1, 2,
        4, ... and the full width).

    Returns:
      The smallest size whose refit head's dev accuracy is at least
      ``reference_dev_accuracy - max_drop``; where none is, the size with
      the best dev accuracy (the smallest of ties).
    """
    train_h = np.asarray(train_h, np.float32)
    dev_h = np.asarray(dev_h, np.float32)
    if train_h.ndim != 2 or dev_h.ndim != 2 or train_h.shape[1] != dev_h.shape[1]:
        raise ValueError(
            "fit_bottleneck needs train and dev representations [N, H] of one "
            f"width; got {train_h.shape} and {dev_h.shape}."
        )
    if not 0.0 <= max_drop < 100.0:
        raise ValueError(
            f"max_drop is in points of accuracy, in [0, 100) (0.5 = half a "
            f"point); got {max_drop}."
        )
    width = train_h.shape[1]
    sizes = list(sizes) if sizes is not None else _sizes(width)
    if not sizes or sorted(sizes) != sizes or sizes[0] < 1 or sizes[-1] > width:
        raise ValueError(
            f"sizes must ascend within [1, {width}] (the width); got {sizes}."
        )
    order = coordinate_order(logits_of, train_h)
    fill = train_h.mean(0)
    curve, fits = [], []
    for k in sizes:
        kept = np.sort(order[:k])
        result = linear_probes.linear_probe(
            train_h[:, kept],
            train_task,
            dev_h[:, kept],
            dev_task,
            dev_h[:, kept],
            dev_task,
            num_classes=num_classes,
        )
        acc = float(result.dev_accuracy)
        curve.append({"k": int(k), "dev_accuracy": acc})
        fits.append((kept, result.kernel, result.bias, acc))
        if acc >= reference_dev_accuracy - max_drop / 100.0:
            break
    else:
        best = max(range(len(fits)), key=lambda i: (fits[i][3], -i))
        fits.append(fits[best])
    kept, kernel_k, bias, acc = fits[-1]
    kernel = np.zeros((width, kernel_k.shape[1]), np.float32)
    kernel[kept] = kernel_k
    # The dropped coordinates are held at a constant, so the kernel's zero
    # rows there lose nothing; the kept ones read h as it is.
    return BottleneckFit(
        coordinates=kept,
        fill=fill.astype(np.float32),
        kernel=kernel,
        bias=np.asarray(bias, np.float32),
        dev_accuracy=acc,
        reference_dev_accuracy=float(reference_dev_accuracy),
        curve=tuple(curve),
    )


def layernorm_delta(
    fit: BottleneckFit, scale: np.ndarray, bias: np.ndarray
) -> dict[str, np.ndarray]:
    """The last LayerNorm's change that makes the encoder's CLS vector
    ``fit.apply(h)``: ``{"scale": delta, "bias": delta}`` (zero at the kept
    coordinates), to add to its ``scale`` and ``bias``."""
    scale = np.asarray(scale, np.float32)
    bias = np.asarray(bias, np.float32)
    if scale.shape != fit.fill.shape or bias.shape != fit.fill.shape:
        raise ValueError(
            f"The LayerNorm's scale {scale.shape} and bias {bias.shape} must "
            f"have the bottleneck's width {fit.fill.shape}."
        )
    dropped = np.ones(fit.fill.shape[0], bool)
    dropped[fit.coordinates] = False
    return {
        "scale": np.where(dropped, -scale, 0.0).astype(np.float32),
        "bias": np.where(dropped, fit.fill - bias, 0.0).astype(np.float32),
    }


def decision_reps(
    logits_of: Callable, reps: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The core head's logits ``[N, C]`` of each split less their mean over
    the classes, as representations: what a probe reads of the core's own
    decision. The softmax ignores a shift shared by all the logits, so that
    shift is no part of the decision; uncentred, it carried gender on the
    main job (a converged MLP: 0.960 against 0.917 centred, stop 59)."""
    out = {}
    for s, h in reps.items():
        logits = np.asarray(logits_of(h), np.float32)
        out[s] = logits - logits.mean(-1, keepdims=True)
    return out


def task_only_reps(
    ctx, rep, head, core_reps, *, max_drop: float = MAX_DROP, bottleneck: bool = True
) -> dict[str, tuple[dict[str, np.ndarray], Callable, dict[str, Any]]]:
    """The task-only references' representations, from the core's:
    ``{"core decision" | "core+bottleneck": (reps by split, predict, info)}``
    (``predict(h) -> int [N]``: the row's task readout; ``info``: what the
    row is, for results.json). ``core_reps`` needs train and dev.
    ``bottleneck=False`` leaves the bottleneck out (its fit and its probes:
    the main job's time budget), the decision row stays."""

    def logits_of(h):
        return rep.head(head, jnp.asarray(h, jnp.float32))

    task = {s: ctx.data.splits[s].task for s in ("train", "dev")}
    decision = decision_reps(logits_of, core_reps)
    rows = {
        "core decision": (
            decision,
            lambda h: np.argmax(h, -1),
            {"kind": "decision", "width": int(decision["train"].shape[1])},
        )
    }
    if not bottleneck:
        return rows
    fit = fit_bottleneck(
        logits_of,
        core_reps["train"],
        task["train"],
        core_reps["dev"],
        task["dev"],
        num_classes=len(ctx.data.task_classes),
        reference_dev_accuracy=float(
            np.mean(np.asarray(rep.predict(head, core_reps["dev"])) == task["dev"])
        ),
        max_drop=max_drop,
    )
    rows["core+bottleneck"] = (
        {s: fit.apply(h) for s, h in core_reps.items()},
        fit.predict,
        {"kind": "bottleneck", "max_drop": float(max_drop), **fit.summary()},
    )
    return rows
