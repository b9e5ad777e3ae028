"""An attribute-penalized task discriminant: a post-hoc remover that holds
against a converged nonlinear probe.

Trained diffs and the linear erasers (INLP, LEACE-style) remove what a
linear reader sees; a probe trained to convergence still reads most of it
(docs/efficacy.md, stops 57-58). What a representation must keep for the
task is, for a linear task readout, at most ``C - 1`` directions. This
module keeps exactly those, chosen so that within each task class the
attribute's groups sit together along them:

    maximize  v' B v  /  v' (W + penalty * A) v

(a generalized eigenproblem; Fisher's discriminant when ``penalty`` is 0)
where ``B`` is the scatter of the task classes' means, ``W`` the pooled
within-class covariance and ``A`` the scatter, inside each task class, of
each attribute group's mean around the class's mean (summed over the
attributes it removes). The representation becomes the ``C - 1`` projections
``(h - mean) v_j``, standardized, read by a linear task head refit on train.

``penalty`` is chosen on dev (:func:`fit_discriminant`): of the penalties
whose refit head's dev accuracy is within ``max_drop`` points of the core's,
the one whose dev leakage, read by a Gaussian-mixture reader
(:func:`gaussian_leakage`), lies closest to the leakage floor (the gold task
label's; :func:`moddiffy_jax.eval.removal.leakage_floor`). Test is never
read.

Like INLP it acts on the core's representation (a projection, not a sparse
weight diff), and for several attributes it removes them together (one
penalty sum). It keeps only the task, so a projection for one attribute
also lowers other attributes that the task does not imply.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from moddiffy_jax._files import replace_safetensors
from moddiffy_jax.eval import discriminant_diff, linear_probes, metrics, removal
from moddiffy_jax.eval.probe_inputs import check_splits
from moddiffy_jax.subnets import diffs as diffs_lib

__all__ = [
    "MAX_DROP",
    "PENALTIES",
    "Discriminant",
    "discriminant_directions",
    "fit_discriminant",
    "gaussian_leakage",
    "load_discriminant",
    "save_discriminant",
    "scatter_matrices",
]

FORMAT_NAME = "moddiffy_discriminant"
FORMAT_VERSION = 1
_ARRAYS = ("mean", "directions", "scale", "kernel", "bias")

#: Default dev-accuracy slack, in points.
MAX_DROP = 0.5
#: Penalties tried, smallest first (0: Fisher's discriminant).
PENALTIES = (0.0, 1.0, 3.0, 10.0, 30.0, 100.0)
#: Fewest examples of an attribute value inside a task class for its mean
#: to enter the attribute scatter.
MIN_GROUP = 5


@dataclasses.dataclass(frozen=True)
class Discriminant:
    """A fitted projection and its refit task head.

    Attributes:
      mean: ``[H]`` train mean subtracted first.
      directions: ``[H, k]`` the kept directions (``k = C - 1`` by default).
      scale: ``[k]`` train standard deviation of each projection.
      kernel, bias: ``[k, C]``, ``[C]``: the task head on the projections.
      penalty: the chosen penalty.
      attributes: the attributes it removes.
      dev_accuracy: the refit head's dev accuracy.
      reference_dev_accuracy: the core head's dev accuracy it was held to.
      candidates: ``{"penalty", "dev_accuracy", "dev_leakage", "dev_floor"}``
        for every penalty tried (``dev_leakage``, ``dev_floor``: by
        attribute).
    """

    mean: np.ndarray
    directions: np.ndarray
    scale: np.ndarray
    kernel: np.ndarray
    bias: np.ndarray
    penalty: float
    attributes: tuple[str, ...]
    dev_accuracy: float
    reference_dev_accuracy: float
    candidates: tuple[dict[str, Any], ...]

    @property
    def k(self) -> int:
        return int(self.directions.shape[1])

    def apply(self, h) -> np.ndarray:
        """``h`` [N, H] -> the standardized projections [N, k]."""
        h = np.asarray(h, np.float32)
        if h.ndim != 2 or h.shape[1] != self.mean.shape[0]:
            raise ValueError(
                f"The discriminant was fitted on width {self.mean.shape[0]}; got "
                f"representations of shape {h.shape}."
            )
        return ((h - self.mean) @ self.directions / self.scale).astype(np.float32)

    def predict(self, projected) -> np.ndarray:
        """Task predictions from :meth:`apply`'s output."""
        return np.argmax(np.asarray(projected) @ self.kernel + self.bias, -1)

    def summary(self) -> dict[str, Any]:
        return {
            "kind": "discriminant",
            "attributes": list(self.attributes),
            "k": self.k,
            "penalty": self.penalty,
            "dev_accuracy": self.dev_accuracy,
            "reference_dev_accuracy": self.reference_dev_accuracy,
            "candidates": [dict(c) for c in self.candidates],
        }


def scatter_matrices(
    train_h, train_task, train_attrs: Mapping[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``(W, B, {attribute: A})`` of the module doc, in float64.

    ``W`` and ``B`` weight each task class by its share of train; ``A``
    weights each (class, value) group by its share of train and leaves out
    groups of fewer than :data:`MIN_GROUP` examples.
    """
    h = np.asarray(train_h, np.float64)
    task = np.asarray(train_task)
    if h.ndim != 2 or len(task) != len(h):
        raise ValueError(
            f"scatter_matrices needs h [N, H] and N task labels; got {h.shape} "
            f"and {task.shape}."
        )
    n, width = h.shape
    mean = h.mean(0)
    within = np.zeros((width, width))
    between = np.zeros((width, width))
    attr_scatter = {a: np.zeros((width, width)) for a in train_attrs}
    for c in np.unique(task):
        in_c = task == c
        hc = h[in_c]
        mc = hc.mean(0)
        d = hc - mc
        within += d.T @ d / n
        between += in_c.mean() * np.outer(mc - mean, mc - mean)
        for a, labels in train_attrs.items():
            ac = np.asarray(labels)[in_c]
            for v in np.unique(ac):
                group = ac == v
                if group.sum() < MIN_GROUP:
                    continue
                shift = hc[group].mean(0) - mc
                attr_scatter[a] += group.sum() / n * np.outer(shift, shift)
    return within, between, attr_scatter


def discriminant_directions(
    within, between, attribute_scatter, *, penalty: float, rank: int
) -> np.ndarray:
    """The ``rank`` leading solutions ``v`` of ``B v = s (W + penalty A) v``
    (``W`` with a ridge of 1e-3 of its mean variance), ``[H, rank]``."""
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0; got {penalty}.")
    width = within.shape[0]
    if not 1 <= rank <= width:
        raise ValueError(f"rank must lie in [1, {width}]; got {rank}.")
    ridge = 1e-3 * max(np.trace(within) / width, 1e-12)
    denom = within + penalty * attribute_scatter + ridge * np.eye(width)
    # B v = s D v with D = L L': the eigenvectors u of L^-1 B L^-T give
    # v = L^-T u.
    chol = np.linalg.cholesky(denom)
    inv = np.linalg.inv(chol)
    values, vectors = np.linalg.eigh(inv @ between @ inv.T)
    top = np.argsort(-values, kind="stable")[:rank]
    return inv.T @ vectors[:, top]


def gaussian_leakage(
    train_h,
    train_attr,
    train_task,
    eval_h,
    eval_attr,
    *,
    num_attr_classes: int,
) -> float:
    """Balanced accuracy of a Gaussian-mixture reader of an attribute.

    ``p(h | a)`` is a mixture over task classes ``c`` (weights
    ``P(c | a)`` on train) of Gaussians fit on the train examples of
    ``(c, a)`` (covariances shrunk towards their diagonal, the more the fewer
    examples); the reader predicts the value of largest ``p(h | a)``: equal
    priors, the rule for balanced accuracy. On a few dimensions it reads
    means, spreads and their mix over classes, what a converged MLP reads, in
    milliseconds. It never sees the eval task labels.
    """
    train_h = np.asarray(train_h, np.float64)
    eval_h = np.asarray(eval_h, np.float64)
    if train_h.ndim == 1:
        train_h, eval_h = train_h[:, None], eval_h[:, None]
    train_attr = np.asarray(train_attr)
    train_task = np.asarray(train_task)
    width = train_h.shape[1]
    loglik = np.full((len(eval_h), num_attr_classes), -np.inf)
    for a in range(num_attr_classes):
        in_a = train_attr == a
        parts = []
        for c in np.unique(train_task[in_a]):
            x = train_h[in_a & (train_task == c)]
            if len(x) < 2:
                continue
            cov = np.atleast_2d(np.cov(x, rowvar=False))
            shrink = min(1.0, max(0.05, width / len(x)))
            cov = (1 - shrink) * cov + shrink * np.diag(np.diag(cov))
            cov += 1e-6 * (np.trace(cov) / width + 1e-12) * np.eye(width)
            _, logdet = np.linalg.slogdet(cov)
            d = eval_h - x.mean(0)
            maha = np.einsum("ij,ij->i", d, np.linalg.solve(cov, d.T).T)
            parts.append(np.log(len(x) / in_a.sum()) - 0.5 * (maha + logdet))
        if parts:
            loglik[:, a] = np.logaddexp.reduce(np.stack(parts), axis=0)
    pred = np.argmax(loglik, -1)
    return metrics.balanced_accuracy(np.asarray(eval_attr), pred, num_attr_classes)


def fit_discriminant(
    train_h,
    train_task,
    dev_h,
    dev_task,
    train_attrs: Mapping[str, np.ndarray],
    dev_attrs: Mapping[str, np.ndarray],
    *,
    num_classes: int,
    num_attr_classes: Mapping[str, int],
    reference_dev_accuracy: float,
    max_drop: float = MAX_DROP,
    penalties: Sequence[float] = PENALTIES,
    rank: int | None = None,
) -> Discriminant:
    """Fits the module doc's projection for ``train_attrs``' attributes.

    Args:
      train_h, train_task: ``[N, H]`` core representations and gold task
        labels of train (scatters and the refit head).
      dev_h, dev_task: the same for dev (the penalty is chosen on them).
      train_attrs, dev_attrs: attribute name -> int labels, one or more
        attributes (removed together).
      num_classes: task classes ``C``.
      num_attr_classes: attribute name -> number of classes.
      reference_dev_accuracy: the core head's dev accuracy.
      max_drop: dev accuracy the module may give up, in points.
      penalties: the penalties tried.
      rank: directions kept (default and most ``C - 1``).

    Returns:
      The chosen :class:`Discriminant`: of the penalties within ``max_drop``
      (all, where none is), the one whose Gaussian dev leakage is closest to
      the dev floor, averaged over the attributes (the smaller penalty on
      ties).
    """
    names = tuple(train_attrs)
    if not names or set(names) != set(dev_attrs):
        raise ValueError(
            "fit_discriminant needs train and dev labels of the same attributes; "
            f"got {sorted(train_attrs)} and {sorted(dev_attrs)}."
        )
    missing = [a for a in names if a not in num_attr_classes]
    if missing:
        raise ValueError(f"num_attr_classes lacks {missing}.")
    if not 0.0 <= max_drop < 100.0:
        raise ValueError(
            f"max_drop is in points of accuracy, in [0, 100) (0.5 = half a "
            f"point); got {max_drop}."
        )
    if num_classes < 2:
        raise ValueError(f"A task needs 2 or more classes; got {num_classes}.")
    rank = num_classes - 1 if rank is None else int(rank)
    if not 1 <= rank <= num_classes - 1:
        raise ValueError(
            f"rank must lie in [1, {num_classes - 1}] (the task's classes less "
            f"one: the class means span no more); got {rank}."
        )
    if not penalties or any(p < 0 for p in penalties):
        raise ValueError(f"penalties must be >= 0; got {list(penalties)}.")
    # Shapes, widths and label ranges, as every probe checks them.
    checked, _ = check_splits(
        {"train": (train_h, train_task), "dev": (dev_h, dev_task)}, num_classes
    )
    (train_h, train_task), (dev_h, dev_task) = checked["train"], checked["dev"]
    train_h = np.asarray(train_h, np.float32)
    dev_h = np.asarray(dev_h, np.float32)
    within, between, attr_scatter = scatter_matrices(
        train_h, train_task, {a: train_attrs[a] for a in names}
    )
    penalty_matrix = sum(attr_scatter[a] for a in names)
    mean = train_h.mean(0)
    floors = {
        a: removal.leakage_floor(
            train_task,
            train_attrs[a],
            dev_task,
            dev_attrs[a],
            num_task_classes=num_classes,
            num_attr_classes=num_attr_classes[a],
        )
        for a in names
    }
    fits = []
    for penalty in sorted(set(float(p) for p in penalties)):
        directions = discriminant_directions(
            within, between, penalty_matrix, penalty=penalty, rank=rank
        ).astype(np.float32)
        train_p = (train_h - mean) @ directions
        scale = train_p.std(0) + 1e-12
        train_p, dev_p = train_p / scale, (dev_h - mean) @ directions / scale
        head = linear_probes.linear_probe(
            train_p,
            train_task,
            dev_p,
            dev_task,
            dev_p,
            dev_task,
            num_classes=num_classes,
        )
        leak = {
            a: gaussian_leakage(
                train_p,
                train_attrs[a],
                train_task,
                dev_p,
                dev_attrs[a],
                num_attr_classes=num_attr_classes[a],
            )
            for a in names
        }
        distance = float(np.mean([abs(leak[a] - floors[a]) for a in names]))
        fits.append(
            (
                penalty,
                directions,
                scale.astype(np.float32),
                head,
                leak,
                distance,
            )
        )
    ok = reference_dev_accuracy - max_drop / 100.0
    within_drop = [f for f in fits if f[3].dev_accuracy >= ok] or fits
    penalty, directions, scale, head, _, _ = min(within_drop, key=lambda f: f[5])
    return Discriminant(
        mean=mean.astype(np.float32),
        directions=directions,
        scale=scale,
        kernel=np.asarray(head.kernel, np.float32),
        bias=np.asarray(head.bias, np.float32),
        penalty=penalty,
        attributes=names,
        dev_accuracy=float(head.dev_accuracy),
        reference_dev_accuracy=float(reference_dev_accuracy),
        candidates=tuple(
            {
                "penalty": f[0],
                "dev_accuracy": float(f[3].dev_accuracy),
                "dev_leakage": {a: float(v) for a, v in f[4].items()},
                "dev_floor": {a: float(v) for a, v in floors.items()},
            }
            for f in fits
        ),
    )


def save_discriminant(
    path: str | os.PathLike, fit: Discriminant, *, base_fingerprint: str = ""
) -> Path:
    """Writes ``fit`` to a safetensors file (its arrays, and its settings as
    JSON metadata with ``base_fingerprint``: the core whose representation
    it projects, :func:`moddiffy_jax.subnets.sparse_diff.fingerprint`).
    Written beside and renamed into place: an existing file is replaced
    whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "base_fingerprint": base_fingerprint,
        "penalty": fit.penalty,
        "attributes": list(fit.attributes),
        "dev_accuracy": fit.dev_accuracy,
        "reference_dev_accuracy": fit.reference_dev_accuracy,
        "candidates": [dict(c) for c in fit.candidates],
    }
    tensors = {k: np.ascontiguousarray(getattr(fit, k), np.float32) for k in _ARRAYS}
    replace_safetensors(path, tensors, {FORMAT_NAME: json.dumps(meta)})
    return path


def load_discriminant(
    path: str | os.PathLike, *, base_fingerprint: str | None = None
) -> Discriminant:
    """Reads :func:`save_discriminant`'s file. With ``base_fingerprint``,
    refuses a file fitted on another core's representation."""
    with safe_open(str(path), framework="numpy") as f:
        raw = (f.metadata() or {}).get(FORMAT_NAME)
        if raw is None:
            raise ValueError(
                f"{path} is not a discriminant file (no {FORMAT_NAME!r} "
                "metadata); write one with save_discriminant."
            )
        arrays = {k: f.get_tensor(k) for k in _ARRAYS}
    meta = json.loads(raw)
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is discriminant format version {meta.get('version')}; this "
            f"library reads version {FORMAT_VERSION}."
        )
    if base_fingerprint is not None and meta["base_fingerprint"] != base_fingerprint:
        raise ValueError(
            f"{path} was fitted on the representation of core "
            f"{meta['base_fingerprint']!r}, not of the given core "
            f"{base_fingerprint!r}: fit it again on this core "
            "(fit_discriminant or python -m moddiffy_jax.evaluate)."
        )
    return Discriminant(
        **arrays,
        penalty=float(meta["penalty"]),
        attributes=tuple(meta["attributes"]),
        dev_accuracy=float(meta["dev_accuracy"]),
        reference_dev_accuracy=float(meta["reference_dev_accuracy"]),
        candidates=tuple(meta["candidates"]),
    )


#: Why the discriminant rows have no attacker reading.
NO_ATTACKER_NOTE = (
    "discriminant: no attacker reading; on its C - 1 projections the "
    "early-stopped attacker is no reader (as on the core decision's logits); "
    "its lin and mlp columns read it."
)


def discriminant_reps(
    ctx,
    rep,
    head,
    core_reps,
    *,
    max_drop: float = MAX_DROP,
    save_dir: str | os.PathLike | None = None,
    base_fingerprint: str = "",
    weights: bool | str = False,
    core_params: Any = None,
    penalties: Sequence[float] = PENALTIES,
    core_parts: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, tuple[dict[str, np.ndarray], Any, dict[str, Any]]]:
    """The rows ``core+discriminant(<attribute>)`` for each of the run's
    attributes and, for several, ``core+discriminant(<a>,<b>,...)`` for all
    together: ``{label: (reps by split, predict, info)}`` from the core's
    representations (``core_reps`` needs train and dev). With ``save_dir``,
    each fit is also written there as ``<a>[,<b>...].safetensors``
    (:func:`save_discriminant`; ``info["file"]`` names it).

    With ``weights`` True or ``"auto"`` (and the core's encoder params
    ``core_params``), each
    fit is written into a sparse diff of the encoder's last layer
    (:mod:`moddiffy_jax.eval.discriminant_diff`) and the row is the encoder
    with that diff added, read by the core's own head (``info["weights"]``:
    entries, kept coordinates, the readout's train R^2, the projection's
    test accuracy; with ``save_dir`` the diff is saved beside the fit as
    ``<a>[,<b>...].diff.safetensors``). ``"auto"`` falls back to the
    projection where the model cannot take the diff (``info["weights"]
    ["skipped"]`` says why); True raises there. Sets whose fits project
    alike (every set at penalty 0) share one diff and one encoding
    (``info["weights"]["same_as"]``). ``penalties``: those tried
    (:func:`fit_discriminant`). ``core_parts``: the core's last-layer parts
    by split (:func:`discriminant_diff.core_parts`), with which the diffs'
    rows need no encoder pass."""
    if weights not in (True, False, "auto"):
        raise ValueError(
            f"config.eval.discriminant.weights={weights!r}: True (write each "
            "discriminant into a diff), False (the projection) or 'auto' (the "
            "diff where the model allows it)."
        )
    if weights and core_params is None:
        raise ValueError(
            "discriminant_reps(weights=...) writes each fit into the core's "
            "weights: pass core_params (the core's encoder params)."
        )
    splits = ctx.data.splits
    task = {s: splits[s].task for s in ("train", "dev")}
    reference = float(
        np.mean(np.asarray(rep.predict(head, core_reps["dev"])) == task["dev"])
    )
    groups = [(a,) for a in ctx.attributes]
    if len(ctx.attributes) > 1:
        groups.append(tuple(ctx.attributes))
    writer, skipped, encoded = None, None, []
    if weights is True:
        writer = discriminant_diff.Writer(
            ctx, rep, head, core_params, core_reps, parts=core_parts
        )
    elif weights == "auto":
        writer, skipped = discriminant_diff.writer_or_reason(
            ctx, rep, head, core_params, core_reps, core_parts
        )
    out = {}
    for group in groups:
        fit = fit_discriminant(
            core_reps["train"],
            task["train"],
            core_reps["dev"],
            task["dev"],
            {a: splits["train"].attrs[a] for a in group},
            {a: splits["dev"].attrs[a] for a in group},
            num_classes=len(ctx.data.task_classes),
            num_attr_classes={a: len(ctx.data.attr_classes[a]) for a in group},
            reference_dev_accuracy=reference,
            max_drop=max_drop,
            penalties=tuple(penalties),
        )
        info = {"max_drop": float(max_drop), **fit.summary()}
        if save_dir is not None:
            path = Path(save_dir) / f"{','.join(group)}.safetensors"
            save_discriminant(path, fit, base_fingerprint=base_fingerprint)
            info["file"] = str(path)
        label = f"core+discriminant({','.join(group)})"
        if writer is None:
            if skipped:
                info["weights"] = {"skipped": skipped}
            if save_dir is not None:  # an earlier evaluation's diff is not this row's
                Path(save_dir, f"{','.join(group)}.diff.safetensors").unlink(
                    missing_ok=True
                )
            out[label] = (
                {s: fit.apply(h) for s, h in core_reps.items()},
                fit.predict,
                info,
            )
            continue
        # Fits that project alike (the main job: penalty 0 for every set,
        # Fisher's direction) share one diff and one encoding.
        same = next((e for e in encoded if _same_projection(e[0], fit)), None)
        if same is None:
            written = writer.write(fit, ",".join(group), base_fingerprint)
            reps = writer.represent(written.diff)
            encoded.append((fit, written, reps, label))
            shared = {}
        else:
            _, written, reps, first = same
            written = dataclasses.replace(
                written, diff=written.diff.replace(name=",".join(group))
            )
            shared = {"same_as": first}
        info["weights"] = {
            **written.record,
            **shared,
            "projection_test_accuracy": _accuracy(
                fit.predict(fit.apply(core_reps["test"])), splits["test"].task
            )
            if "test" in core_reps
            else None,
        }
        if save_dir is not None:
            path = Path(save_dir) / f"{','.join(group)}.diff.safetensors"
            diffs_lib.save_sparse_diff(path, written.diff, overwrite=True)
            info["weights"]["file"] = str(path)
        out[label] = (reps, writer.predict, info)
    return out


def _same_projection(a: Discriminant, b: Discriminant) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("mean", "directions", "scale", "kernel", "bias")
    )


def _accuracy(pred, gold) -> float:
    return float(np.mean(np.asarray(pred) == np.asarray(gold)))
