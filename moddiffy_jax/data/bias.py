"""The bias-only model: per-example log-probabilities for known-bias debiasing.

The SRNets losses (product of experts, example reweighting, confidence
regularisation; spec A7) need, for every training example, the log-probabilities
``b`` [N, C] of a *bias-only* model over the task classes. This module produces
them in one of three ways, chosen by ``data.bias.source``:

* ``"attribute"``: a multinomial logistic regression on the one-hot encoding of
  protected attributes (``data.bias.attributes``), fitted on the train split's
  task labels.
* ``"features"``: the same regression on hand-crafted features of
  ``(text, text_pair)``; ``"word_overlap"`` is the overlap family of the
  MNLI -> HANS bias model (spec A8, :func:`nli.word_overlap_features`).
* ``"file"``: ``.npy`` arrays [N_split, C] shipped with the reference (spec A8),
  row-aligned with the rows of each split's file; no model is trained.

The regression is fitted by full-batch Newton's method with a backtracking
line search (float64, deterministic, a few milliseconds for 10k rows x 10
features). It minimises ``sum_i w_i CE_i + l2/2 ||W||^2`` with unpenalised
intercepts and ``w_i`` the ``"balanced"`` class weight ``N / (K n_{y_i})``
(``"none"``: 1), i.e. scikit-learn's ``LogisticRegression`` objective with
``C = 1 / l2``. ``binary_positive`` fits "class X vs rest" and expands the two
log-probabilities ``[v0, v1]`` to C classes: ``v1`` for X and
``v0 - log(C - 1)`` for every other class (MNLI with X = entailment:
``[v0 - ln 2, v1, v0 - ln 2]``, spec A8).

An example is *bias-aligned* when the bias model's argmax equals its gold
label (:func:`bias_aligned`), *bias-conflicting* otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import ml_collections
import numpy as np

from moddiffy_jax.data import nli
from moddiffy_jax.data.dataset import RawSplit, TextDataset, TokenizedDataset

BIAS_KEY = "bias_logprobs"
BIAS_SOURCES = ("attribute", "features", "file")
FILE_KINDS = ("log_probs", "probs")
CLASS_WEIGHTS = ("balanced", "none")

# Rows of a probability file must sum to 1 within this tolerance.
ROW_SUM_ATOL = 1e-3


def _word_overlap(
    text: Sequence[str], text_pair: Sequence[str]
) -> tuple[np.ndarray, tuple[str, ...]]:
    return nli.word_overlap_features(text, text_pair), nli.OVERLAP_FEATURE_NAMES


# Feature family name -> fn(text [N], text_pair [N]) -> (float [N, F], F names).
FEATURE_FAMILIES: dict[
    str,
    Callable[[Sequence[str], Sequence[str]], tuple[np.ndarray, tuple[str, ...]]],
] = {"word_overlap": _word_overlap}


def default_bias_config() -> ml_collections.ConfigDict:
    """Returns ``data.bias``: the bias-only model's settings (see module doc).

    Fields:

    - ``source``: ``""`` (no bias model), ``"attribute"``, ``"features"`` or
      ``"file"``.
    - ``attributes``: ``"attribute"`` source: the protected attributes whose
      one-hot encodings are the features, e.g. ``("dialect",)``.
    - ``features``: ``"features"`` source: the feature family of
      ``(text, text_pair)`` (one of :data:`FEATURE_FAMILIES`).
    - ``files.{train,dev,test}``: ``"file"`` source: ``.npy`` float
      ``[N_split, C]`` per split, row-aligned with that split's file rows
      (train is required; a split without a file carries no bias extras).
    - ``file_kind``: ``"log_probs"`` or ``"probs"`` (converted to log-probs).
    - ``l2``: L2 strength of the logistic regression (``1 / C`` in
      scikit-learn's terms; the reference's MNLI model used ``C = 100``, i.e.
      ``l2 = 0.01``).
    - ``class_weight``: ``"balanced"`` or ``"none"``.
    - ``binary_positive``: a task class name X to fit "X vs rest" and expand to
      C classes; empty: multiclass.
    """
    c = ml_collections.ConfigDict()
    c.source = ""
    c.attributes = ()
    c.features = "word_overlap"
    c.files = ml_collections.ConfigDict({"train": "", "dev": "", "test": ""})
    c.file_kind = "log_probs"
    c.l2 = 1.0
    c.class_weight = "balanced"
    c.binary_positive = ""
    return c


# ---------------------------------------------------------------- regression


class LogisticRegression(NamedTuple):
    """A fitted multinomial logistic regression.

    Attributes:
      weights: float64 ``[F, K]``.
      intercept: float64 ``[K]``.
      class_weights: float64 ``[K]``, the sample weight of each class used in
        the fit.
      iterations: Newton iterations taken.
      converged: whether the Newton decrement fell below the tolerance.
    """

    weights: np.ndarray
    intercept: np.ndarray
    class_weights: np.ndarray
    iterations: int
    converged: bool


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def fit_logistic_regression(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    num_classes: int,
    l2: float,
    class_weight: str = "balanced",
    max_iter: int = 100,
    tol: float = 1e-10,
) -> LogisticRegression:
    """Fits a multinomial logistic regression by full-batch Newton's method.

    Minimises ``sum_i w_{y_i} CE(x_i W + b, y_i) + l2/2 ||W||_F^2`` (the
    intercept ``b`` is not penalised). Deterministic.

    Args:
      features: float ``[N, F]``.
      labels: int (or bool) ``[N]`` in ``[0, num_classes)``; every class must
        occur.
      num_classes: ``K >= 2``.
      l2: L2 strength (> 0).
      class_weight: ``"balanced"`` (``w_k = N / (K n_k)``) or ``"none"``.
      max_iter: Newton iteration cap.
      tol: stop when the Newton decrement ``-g.d / 2`` is below
        ``tol * sum_i w_i``.

    Returns:
      The :class:`LogisticRegression`.

    Raises:
      ValueError: bad shapes, ``l2 <= 0``, an unknown ``class_weight`` or a
        class without examples.
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_):
        raise ValueError(f"labels must be integer class ids, got {y.dtype}.")
    y = y.astype(np.int64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(
            f"features must be [N, F] and labels [N]; got {list(x.shape)} and "
            f"{list(y.shape)}."
        )
    if not np.all(np.isfinite(x)):
        raise ValueError("features contain NaN or inf; fix the feature builder.")
    if l2 <= 0:
        raise ValueError(f"l2 must be > 0, got {l2}.")
    if class_weight not in CLASS_WEIGHTS:
        raise ValueError(
            f"Unknown class_weight {class_weight!r}; valid: {list(CLASS_WEIGHTS)}."
        )
    n, f = x.shape
    if num_classes < 2 or y.min() < 0 or y.max() >= num_classes:
        raise ValueError(
            f"labels must lie in [0, num_classes) with num_classes >= 2; got "
            f"num_classes={num_classes}, labels in [{y.min()}, {y.max()}]."
        )
    counts = np.bincount(y, minlength=num_classes)
    if (counts == 0).any():
        raise ValueError(
            f"Classes {np.flatnonzero(counts == 0).tolist()} have no example in the "
            "bias model's training data, so their log-probabilities are undefined. "
            "Fix: use more train rows (data.max_examples_per_split) or a binary "
            "model (data.bias.binary_positive)."
        )
    if class_weight == "balanced":
        cw = n / (num_classes * counts.astype(np.float64))
    else:
        cw = np.ones(num_classes)
    w = cw[y]
    x1 = np.concatenate([x, np.ones((n, 1))], axis=1)  # [N, F+1]
    onehot = np.eye(num_classes)[y]
    penalty = np.ones((f + 1, 1))
    penalty[-1] = 0.0  # intercept row is not penalised

    def loss_of(theta):
        logp = _log_softmax(x1 @ theta)
        return -np.sum(w * logp[np.arange(n), y]) + 0.5 * l2 * np.sum(
            penalty * theta**2
        )

    theta = np.zeros((f + 1, num_classes))
    loss = loss_of(theta)
    total_w = float(w.sum())
    d = f + 1
    converged = False
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        p = np.exp(_log_softmax(x1 @ theta))  # [N, K]
        grad = x1.T @ (w[:, None] * (p - onehot)) + l2 * penalty * theta
        hess = np.empty((d, num_classes, d, num_classes))
        for c in range(num_classes):
            for k in range(c, num_classes):
                s = w * p[:, c] * ((c == k) - p[:, k])
                block = (x1 * s[:, None]).T @ x1
                hess[:, c, :, k] = block
                hess[:, k, :, c] = block.T
        hess = hess.reshape(d * num_classes, d * num_classes)
        hess[np.diag_indices_from(hess)] += l2 * np.repeat(penalty[:, 0], num_classes)
        # The intercepts are only defined up to a common shift (a null
        # direction of the Hessian); lstsq returns the minimum-norm step.
        step = -np.linalg.lstsq(hess, grad.reshape(-1), rcond=None)[0]
        step = step.reshape(d, num_classes)
        decrement = -float(np.sum(grad * step)) / 2
        if decrement < tol * total_w:
            converged = True
            break
        t = 1.0  # backtracking (Armijo) line search
        new_loss = loss_of(theta + step)
        while new_loss > loss - 0.5 * t * decrement and t > 1e-12:
            t *= 0.5
            new_loss = loss_of(theta + t * step)
        if new_loss > loss:  # no descent left: numerically at the optimum
            break
        theta = theta + t * step
        loss = new_loss
    theta[-1] -= theta[-1].mean()  # canonical intercepts (sum zero)
    return LogisticRegression(
        weights=theta[:-1],
        intercept=theta[-1],
        class_weights=cw,
        iterations=iterations,
        converged=converged,
    )


def predict_log_probs(model: LogisticRegression, features: np.ndarray) -> np.ndarray:
    """Log-softmax of a fitted regression: float ``[N, F]`` -> float32 ``[N, K]``."""
    x = np.asarray(features, dtype=np.float64)
    return _log_softmax(x @ model.weights + model.intercept).astype(np.float32)


def expand_binary_log_probs(
    log_probs: np.ndarray, *, positive: int, num_classes: int
) -> np.ndarray:
    """Expands "positive vs rest" log-probs ``[v0, v1]`` to ``num_classes``.

    The positive class gets ``v1``; each of the ``C - 1`` other classes gets
    ``v0 - log(C - 1)`` (an equal share of the rest's probability), so rows
    still sum to 1 after ``exp``. For MNLI (contradiction, entailment, neutral)
    with positive entailment this is [D]'s ``[v0 - ln 2, v1, v0 - ln 2]``.

    Args:
      log_probs: float ``[N, 2]``; column 0 = rest, column 1 = positive.
      positive: index of the positive class among the ``C`` task classes.
      num_classes: ``C >= 2``.

    Returns:
      float32 ``[N, C]``.
    """
    log_probs = np.asarray(log_probs, dtype=np.float64)
    if log_probs.ndim != 2 or log_probs.shape[1] != 2:
        raise ValueError(f"log_probs must be [N, 2], got {list(log_probs.shape)}.")
    if not 0 <= positive < num_classes:
        raise ValueError(f"positive must be in [0, {num_classes}), got {positive}.")
    out = np.repeat(log_probs[:, :1] - np.log(num_classes - 1), num_classes, axis=1)
    out[:, positive] = log_probs[:, 1]
    return out.astype(np.float32)


# ---------------------------------------------------------------- features


def attribute_features(
    split: RawSplit,
    attributes: Sequence[str],
    attr_classes: Mapping[str, Sequence[str]],
) -> tuple[np.ndarray, tuple[str, ...]]:
    """One-hot encodings of protected attributes, concatenated.

    Args:
      split: a raw split (``N`` rows).
      attributes: attribute names, in order.
      attr_classes: attribute name -> class names (the dataset's).

    Returns:
      ``(float32 [N, sum_a |classes_a|], names "<attr>=<class>")``.

    Raises:
      ValueError: no attributes, or a name the dataset does not have (lists
        the dataset's attributes).
    """
    if not attributes:
        raise ValueError(
            "data.bias.source='attribute' needs data.bias.attributes, e.g. "
            f"('dialect',); the dataset's attributes are {list(attr_classes)}."
        )
    unknown = [a for a in attributes if a not in attr_classes]
    if unknown:
        raise ValueError(
            f"data.bias.attributes names {unknown}, which the dataset does not "
            f"have; its attributes are {list(attr_classes)}."
        )
    blocks, names = [], []
    for a in attributes:
        classes = attr_classes[a]
        blocks.append(np.eye(len(classes), dtype=np.float32)[split.attrs[a]])
        names += [f"{a}={c}" for c in classes]
    return np.concatenate(blocks, axis=1), tuple(names)


def pair_features(split: RawSplit, family: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """Hand-crafted features of ``(text, text_pair)`` from a named family.

    Args:
      split: a raw split with ``text_pair``.
      family: a key of :data:`FEATURE_FAMILIES` (e.g. ``"word_overlap"``).

    Returns:
      ``(float32 [N, F], F feature names)``.

    Raises:
      ValueError: an unknown family (lists the valid ones) or a split without
        text pairs.
    """
    if family not in FEATURE_FAMILIES:
        raise ValueError(
            f"Unknown data.bias.features {family!r}; valid: {sorted(FEATURE_FAMILIES)}."
        )
    if split.text_pair is None:
        raise ValueError(
            f"data.bias.features={family!r} needs sentence pairs, but the dataset "
            "has no text_pair. Use a pair source (mnli, qqp, fever, ...) or set "
            "data.columns.text_pair, or use data.bias.source='attribute'."
        )
    feats, names = FEATURE_FAMILIES[family](split.text, split.text_pair)
    return np.asarray(feats, dtype=np.float32), tuple(names)


def _features(
    dataset: TextDataset, split: RawSplit, bias_config: ml_collections.ConfigDict
) -> tuple[np.ndarray, tuple[str, ...]]:
    if bias_config.source == "attribute":
        return attribute_features(
            split, tuple(bias_config.attributes), dataset.attr_classes
        )
    return pair_features(split, bias_config.features)


# ---------------------------------------------------------------- files


def read_bias_file(
    path: str,
    *,
    num_examples: int,
    num_classes: int,
    kind: str,
    where: str = "data.bias.files",
) -> np.ndarray:
    """Reads a bias-prediction ``.npy`` file and returns log-probabilities.

    Args:
      path: ``.npy`` float ``[num_examples, num_classes]`` (pickles are
        refused: convert a reference ``.pkl`` dict to a row-aligned array).
      num_examples: expected rows ``N``.
      num_classes: expected columns ``C``.
      kind: ``"log_probs"`` or ``"probs"``.
      where: the config key naming the file (for messages).

    Returns:
      float32 ``[N, C]`` log-probabilities (probabilities are clipped at the
      smallest normal float32 before the log, so zeros stay finite).

    Raises:
      FileNotFoundError: a missing file.
      ValueError: wrong shape, non-float data, NaN, or rows that do not sum to
        1 after ``exp`` (within :data:`ROW_SUM_ATOL`).
    """
    if kind not in FILE_KINDS:
        raise ValueError(
            f"Unknown data.bias.file_kind {kind!r}; valid: {list(FILE_KINDS)}."
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Bias file {path!r} ({where}) not found. Set {where} to a .npy array "
            f"[N, C] of {kind.replace('_', '-')} row-aligned with the split's file."
        )
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ValueError(
            f"Bias file {path!r} ({where}) is not a plain .npy array ({e}). Convert "
            "a pickled dict (e.g. the reference's QQP .pkl) to a float array whose "
            "rows follow the split's file rows."
        ) from e
    expected = (num_examples, num_classes)
    if arr.shape != expected:
        raise ValueError(
            f"Bias file {path!r} ({where}) has shape {list(arr.shape)}, expected "
            f"{list(expected)} (rows of the split as read from its file x task "
            "classes). Fix: point it at the predictions for this split and task."
        )
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"Bias file {path!r} ({where}) holds {arr.dtype}, not floats.")
    arr = arr.astype(np.float64)
    if np.isnan(arr).any():
        raise ValueError(f"Bias file {path!r} ({where}) contains NaN.")
    if kind == "probs":
        if (arr < 0).any():
            raise ValueError(
                f"Bias file {path!r} ({where}) has negative probabilities; if it "
                "holds log-probabilities set data.bias.file_kind='log_probs'."
            )
        probs = arr
        log_probs = np.log(np.maximum(arr, np.finfo(np.float32).tiny))
    else:
        if (arr > 1e-6).any():
            raise ValueError(
                f"Bias file {path!r} ({where}) has positive log-probabilities; if "
                "it holds probabilities set data.bias.file_kind='probs'."
            )
        probs = np.exp(arr)
        log_probs = np.maximum(arr, np.log(np.finfo(np.float32).tiny))
    sums = probs.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > ROW_SUM_ATOL)
    if bad.size:
        raise ValueError(
            f"Rows of bias file {path!r} ({where}) do not sum to 1 after exp "
            f"(file_kind={kind!r}); first bad row {int(bad[0])} sums to "
            f"{float(sums[bad[0]]):.6f}. Check data.bias.file_kind."
        )
    return log_probs.astype(np.float32)


# ---------------------------------------------------------------- the model


def bias_aligned(bias_logprobs: np.ndarray, task_labels: np.ndarray) -> np.ndarray:
    """Whether the bias model's argmax equals the gold label, per example.

    Args:
      bias_logprobs: float ``[N, C]`` log-probabilities (or probabilities or
        logits: only the argmax matters; ties go to the lowest class).
      task_labels: int ``[N]`` gold labels.

    Returns:
      bool ``[N]``: True = bias-aligned, False = bias-conflicting.
    """
    b = np.asarray(bias_logprobs)
    y = np.asarray(task_labels)
    if b.ndim != 2 or y.shape != (b.shape[0],):
        raise ValueError(
            f"bias_logprobs must be [N, C] and task_labels [N]; got "
            f"{list(b.shape)} and {list(y.shape)}."
        )
    return np.argmax(b, axis=-1) == y


def _split_summary(log_probs: np.ndarray, task: np.ndarray) -> dict:
    aligned = bias_aligned(log_probs, task)
    return {
        "num_examples": int(task.shape[0]),
        "accuracy": float(aligned.mean()) if aligned.size else float("nan"),
        "num_aligned": int(aligned.sum()),
        "num_conflicting": int((~aligned).sum()),
    }


def summarize_bias_splits(dataset: TextDataset | TokenizedDataset) -> dict:
    """Bias-model accuracy and aligned/conflicting counts per split.

    Args:
      dataset: a dataset whose splits may carry ``extras["bias_logprobs"]``.

    Returns:
      ``{split: {"num_examples", "accuracy", "num_aligned", "num_conflicting"}}``
      for the splits that carry bias log-probs.
    """
    return {
        name: _split_summary(split.extras[BIAS_KEY], split.task)
        for name, split in dataset.splits.items()
        if BIAS_KEY in split.extras
    }


def check_bias_config(bias_config: ml_collections.ConfigDict) -> None:
    """Raises ValueError for an unknown source/kind/weighting in ``data.bias``."""
    if bias_config.source and bias_config.source not in BIAS_SOURCES:
        raise ValueError(
            f"Unknown data.bias.source {bias_config.source!r}; valid: "
            f"{['', *BIAS_SOURCES]} ('' = no bias model)."
        )
    if bias_config.file_kind not in FILE_KINDS:
        raise ValueError(
            f"Unknown data.bias.file_kind {bias_config.file_kind!r}; valid: "
            f"{list(FILE_KINDS)}."
        )
    if bias_config.class_weight not in CLASS_WEIGHTS:
        raise ValueError(
            f"Unknown data.bias.class_weight {bias_config.class_weight!r}; valid: "
            f"{list(CLASS_WEIGHTS)}."
        )


def compute_bias_extras(
    dataset: TextDataset, bias_config: ml_collections.ConfigDict
) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """Computes the bias-only model's log-probabilities for every split.

    ``"attribute"``/``"features"``: fits the regression on the train split of
    ``dataset`` (its final rows: call it after truncation and balancing) and
    applies it to every split. ``"file"``: reads ``bias_config.files.<split>``,
    which must have one row per row of ``dataset``'s split, so call it on the
    dataset as the source read it (before truncation/balancing) and carry the
    arrays along (``RawSplit.extras`` does; see ``data/config.py``).

    Args:
      dataset: the text dataset.
      bias_config: ``data.bias`` (see :func:`default_bias_config`).

    Returns:
      ``(extras, summary)``: ``extras[split] = {"bias_logprobs": float32
      [N_split, C]}`` (with ``"file"``, only splits with a file), and a
      JSON-serialisable summary ``{"source", "num_classes", "splits": {split:
      {"num_examples", "accuracy", "num_aligned", "num_conflicting"}}, ...}``
      where ``accuracy`` is the bias model's accuracy on the gold labels;
      fitted models add ``"features"``, ``"class_weights"`` ({class: weight}),
      ``"l2"``, ``"binary_positive"``, ``"iterations"``, ``"converged"``.

    Raises:
      ValueError: ``bias_config.source`` empty or unknown, and the errors of
        the feature builders, the fit and :func:`read_bias_file`.
    """
    check_bias_config(bias_config)
    source = bias_config.source
    if not source:
        raise ValueError("data.bias.source is empty: no bias model is configured.")
    classes = dataset.task_classes
    num_classes = len(classes)
    summary: dict = {"source": source, "num_classes": num_classes}
    extras: dict[str, dict[str, np.ndarray]] = {}
    if source == "file":
        files = dict(bias_config.files)
        if not files.get("train"):
            raise ValueError(
                "data.bias.source='file' needs data.bias.files.train (the train "
                "split's bias log-probs, used by the debiasing losses)."
            )
        unknown = sorted(set(files) - set(("train", "dev", "test")))
        if unknown:
            raise ValueError(f"data.bias.files has unknown splits {unknown}.")
        for name, split in dataset.splits.items():
            if not files.get(name):
                continue
            extras[name] = {
                BIAS_KEY: read_bias_file(
                    files[name],
                    num_examples=len(split),
                    num_classes=num_classes,
                    kind=bias_config.file_kind,
                    where=f"data.bias.files.{name}",
                )
            }
        summary["files"] = {k: v for k, v in files.items() if v}
        summary["file_kind"] = bias_config.file_kind
    else:
        if "train" not in dataset.splits:
            raise ValueError("The bias model is fitted on the train split; load it.")
        train = dataset.splits["train"]
        feats, names = _features(dataset, train, bias_config)
        positive = bias_config.binary_positive
        if positive:
            if positive not in classes:
                raise ValueError(
                    f"data.bias.binary_positive={positive!r} is not a task class; "
                    f"the task classes are {list(classes)}."
                )
            pos = classes.index(positive)
            fit_labels = (train.task == pos).astype(np.int64)
            model_classes = (f"not {positive}", positive)
        else:
            fit_labels = train.task
            model_classes = tuple(classes)
        model = fit_logistic_regression(
            feats,
            fit_labels,
            num_classes=len(model_classes),
            l2=float(bias_config.l2),
            class_weight=bias_config.class_weight,
        )
        for name, split in dataset.splits.items():
            x = feats if name == "train" else _features(dataset, split, bias_config)[0]
            log_probs = predict_log_probs(model, x)
            if positive:
                log_probs = expand_binary_log_probs(
                    log_probs, positive=pos, num_classes=num_classes
                )
            extras[name] = {BIAS_KEY: log_probs}
        summary.update(
            {
                "features": list(names),
                "feature_family": (
                    bias_config.features if source == "features" else "one-hot"
                ),
                "attributes": list(bias_config.attributes)
                if source == "attribute"
                else [],
                "l2": float(bias_config.l2),
                "class_weight": bias_config.class_weight,
                "binary_positive": positive,
                "model_classes": list(model_classes),
                "class_weights": {
                    c: float(w)
                    for c, w in zip(model_classes, model.class_weights, strict=True)
                },
                "iterations": int(model.iterations),
                "converged": bool(model.converged),
                "fit_split": "train",
                "num_fit_examples": len(train),
            }
        )
    summary["splits"] = {
        name: _split_summary(e[BIAS_KEY], dataset.splits[name].task)
        for name, e in extras.items()
    }
    return extras, summary
