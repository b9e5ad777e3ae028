"""Linear probe: class-balanced multinomial logistic regression (full-batch L-BFGS).

Re-exported by :mod:`moddiffy_jax.eval.probes`, beside the MLP attacker
ensembles; see there for the shared input checks and the standardizer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moddiffy_jax.eval import metrics, probe_inputs
from moddiffy_jax.eval.probe_inputs import standardizer  # noqa: F401  (docs link)
from moddiffy_jax.objectives.classification import cross_entropy


@dataclasses.dataclass(frozen=True)
class LinearProbeResult:
    """Outcome of :func:`linear_probe`.

    Attributes:
      dev_balanced_accuracy: Balanced accuracy on dev (``NaN`` if undefined).
      test_balanced_accuracy: Balanced accuracy on test (``NaN`` if undefined).
      dev_accuracy: Accuracy on dev.
      test_accuracy: Accuracy on test.
      kernel: [H, C] weights.
      bias: [C] biases.
      num_steps: L-BFGS iterations run.
      converged: Whether the gradient norm reached ``tol``.
      notes: Reasons for any ``NaN``.
    """

    dev_balanced_accuracy: float
    test_balanced_accuracy: float
    dev_accuracy: float
    test_accuracy: float
    kernel: np.ndarray
    bias: np.ndarray
    num_steps: int
    converged: bool
    notes: tuple[str, ...] = ()

    def summary(self) -> dict[str, float]:
        """The four scalar metrics as a flat dict."""
        return {
            "dev_balanced_accuracy": self.dev_balanced_accuracy,
            "test_balanced_accuracy": self.test_balanced_accuracy,
            "dev_accuracy": self.dev_accuracy,
            "test_accuracy": self.test_accuracy,
        }


@functools.partial(jax.jit, static_argnames=("num_classes", "max_steps"))
def _fit_lbfgs(x, y, class_w, l2, tol, *, num_classes: int, max_steps: int):
    """Full-batch L-BFGS (zoom line search) on L2-penalised softmax regression."""
    width = x.shape[1]

    def loss_fn(p):
        logits = x @ p["kernel"] + p["bias"]
        return cross_entropy(logits, y, class_w[y]) + 0.5 * l2 * jnp.sum(
            p["kernel"] ** 2
        )

    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss_fn)
    params = {
        "kernel": jnp.zeros((width, num_classes), jnp.float32),
        "bias": jnp.zeros((num_classes,), jnp.float32),
    }

    def cond(carry):
        _, _, step, grad_norm = carry
        return (step < max_steps) & (grad_norm > tol)

    def body(carry):
        p, state, step, _ = carry
        value, grad = value_and_grad(p, state=state)
        updates, state = opt.update(
            grad, state, p, value=value, grad=grad, value_fn=loss_fn
        )
        return optax.apply_updates(p, updates), state, step + 1, optax.tree.norm(grad)

    init = (params, opt.init(params), jnp.zeros((), jnp.int32), jnp.array(jnp.inf))
    params, _, steps, _ = jax.lax.while_loop(cond, body, init)
    final_grad_norm = optax.tree.norm(jax.grad(loss_fn)(params))
    return params, steps, final_grad_norm


def fit_logistic_regression(
    h,
    y,
    *,
    num_classes: int,
    l2: float = 1e-3,
    max_steps: int = 500,
    tol: float = 1e-5,
    class_weighted: bool = False,
) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """Multinomial logistic regression, full batch, L-BFGS.

    Minimises ``mean_i CE(h_i @ W + b, y_i) + l2 / 2 * ||W||^2`` (the bias is
    not penalised) from ``W = 0, b = 0``; deterministic. With ``l2 > 0`` the
    rows of the optimum satisfy ``sum_c W[:, c] = 0``.

    Args:
      h: [N, H] float features.
      y: [N] int labels in ``[0, num_classes)``.
      num_classes: ``C``.
      l2: L2 penalty on the kernel.
      max_steps: L-BFGS iteration cap.
      tol: Stop when the gradient norm falls to ``tol``.
      class_weighted: Weight the loss by ``N / (C * n_c)``.

    Returns:
      ``(kernel [H, C], bias [C], num_steps, converged)``.
    """
    h, y = probe_inputs.check_split(h, y, num_classes, "train")
    class_w = probe_inputs.class_weights(y, num_classes, class_weighted)
    params, steps, grad_norm = _fit_lbfgs(
        h, y, class_w, l2, tol, num_classes=num_classes, max_steps=max_steps
    )
    params = jax.device_get(params)
    return (
        np.asarray(params["kernel"]),
        np.asarray(params["bias"]),
        int(steps),
        bool(grad_norm <= tol) or int(steps) < max_steps,
    )


def linear_probe(
    train_h,
    train_y,
    dev_h,
    dev_y,
    test_h,
    test_y,
    *,
    num_classes: int,
    l2: float = 1e-3,
    max_steps: int = 500,
    tol: float = 1e-5,
    class_weighted: bool = False,
    standardize: bool = True,
) -> LinearProbeResult:
    """Linear (logistic-regression) probe; see :func:`fit_logistic_regression`.

    Args:
      train_h: [N_train, H] representations.
      train_y: [N_train] int labels in ``[0, num_classes)``.
      dev_h: [N_dev, H].
      dev_y: [N_dev].
      test_h: [N_test, H].
      test_y: [N_test].
      num_classes: ``C >= 2``.
      l2: L2 penalty on the kernel.
      max_steps: L-BFGS iteration cap.
      tol: Gradient-norm tolerance.
      class_weighted: Weight the loss by ``N / (C * n_c)``.
      standardize: Fit on the representations standardized with the train
        split's statistics (:func:`standardizer`); ``kernel`` and ``bias``
        of the result are in the raw coordinates either way.

    Returns:
      A :class:`LinearProbeResult`.

    Raises:
      ValueError: On malformed inputs, empty splits, or a single-class train
        split. A single-class dev/test split gives ``NaN`` and a note.
    """
    splits, notes = probe_inputs.check_splits(
        {"train": (train_h, train_y), "dev": (dev_h, dev_y), "test": (test_h, test_y)},
        num_classes,
    )
    splits, mean, scale = probe_inputs.standardized(splits, standardize)
    kernel, bias, steps, converged = fit_logistic_regression(
        *splits["train"],
        num_classes=num_classes,
        l2=l2,
        max_steps=max_steps,
        tol=tol,
        class_weighted=class_weighted,
    )
    if not converged:
        notes.append(f"L-BFGS did not reach tol={tol} in {max_steps} steps.")
    scores = {}
    for split in ("dev", "test"):
        h, y = splits[split]
        pred = np.argmax(h @ kernel + bias, axis=-1)
        scores[f"{split}_balanced_accuracy"] = metrics.balanced_accuracy(
            y, pred, num_classes
        )
        scores[f"{split}_accuracy"] = metrics.accuracy(y, pred)
    # Back to the raw representations' coordinates: h @ K' + b'.
    kernel = kernel / scale[:, None]
    bias = bias - mean @ kernel
    return LinearProbeResult(
        **scores,
        kernel=kernel,
        bias=bias,
        num_steps=steps,
        converged=converged,
        notes=tuple(notes),
    )
