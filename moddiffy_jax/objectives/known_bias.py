"""Known-bias debiasing losses as pure functions.

These are the three losses of the SRNets reference
(``hg_transformers/clf_distill_loss_functions.py``, spec §A7), for a main
model with logits ``z`` [B, C], gold labels ``y`` [B], and a frozen bias-only
model's probabilities ``p^b`` [B, C]:

* Product of experts (Clark et al. 2019, ``BiasProductBaseline``):
  ``mean_i CE(log_softmax(z_i) + log p^b_i, y_i)``; the sum is renormalised
  inside the CE.
* Example reweighting (``ReweightBaseline``): ``w_i = 1 - p^b_{i,y_i}``,
  ``sum_i w_i CE_i / sum_i w_i``, normalised by the batch sum of the weights,
  not by B.
* Confidence regularisation (Utama et al. 2020, ``SmoothedDistillLoss``):
  ``t~_ij = t_ij^{s_i} / sum_k t_ik^{s_i}`` with ``s_i = 1 - p^b_{i,y_i}`` and
  ``t`` the probabilities of a standard fine-tuned teacher;
  ``mean_i -sum_j t~_ij log softmax(z_i)_j``.

Differences from the reference, all deliberate:

* The reference reads bias **log**-probabilities; these functions take
  probabilities (``bias_probs``) and clip them to ``eps`` before the log in
  PoE, so a zero probability gives a large finite penalty instead of -inf.
  Pass ``jnp.exp(bias_log_probs)`` to use the reference's files.
* Bias and teacher probabilities are wrapped in ``jax.lax.stop_gradient``.
  In the reference they are data tensors without gradients, so this only
  matters when a caller computes them with a differentiable model.
* Reweighting divides by ``max(sum_i w_i, 1e-12)``: a batch where the bias
  model is certain and right on every example (all weights 0) gives a loss of
  0 instead of the reference's 0/0 = NaN.
* Everything is computed in float32, as ``cross_entropy`` does.

The spec lists no bugs in these three losses; the annealed variants
(``--anneal_bias_range``) are unused by the released scripts and are not
ported.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def _bias_prob_of_label(bias_probs: jax.Array, labels: jax.Array) -> jax.Array:
    """[B, C] probabilities, [B] labels -> [B] probability of the label."""
    return jnp.take_along_axis(bias_probs, labels[:, None], axis=-1)[:, 0]


def product_of_experts_loss(
    logits: jax.Array,
    labels: jax.Array,
    bias_probs: jax.Array,
    *,
    eps: float = 1e-12,
) -> jax.Array:
    """Product-of-experts (PoE) loss with a frozen bias-only model.

    ``mean_i -log softmax(log_softmax(z_i) + log p^b_i)[y_i]``.

    Args:
      logits: [B, C] float logits of the main model.
      labels: [B] int class ids.
      bias_probs: [B, C] bias-only model probabilities; no gradient flows into
        them. Rows need not be normalised (the product is renormalised).
      eps: lower clip on ``bias_probs`` before the log.

    Returns:
      A scalar, the mean over the batch.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    bias_probs = jax.lax.stop_gradient(bias_probs.astype(jnp.float32))
    bias_log_probs = jnp.log(jnp.maximum(bias_probs, eps))
    losses = optax.softmax_cross_entropy_with_integer_labels(
        log_probs + bias_log_probs, labels
    )
    return jnp.mean(losses)


def example_reweighting_loss(
    logits: jax.Array, labels: jax.Array, bias_probs: jax.Array
) -> jax.Array:
    """Cross-entropy reweighted by how wrong the bias-only model is.

    ``w_i = 1 - p^b_{i,y_i}``; returns ``sum_i w_i CE_i / sum_i w_i``
    (normalised by the batch sum of weights, as in the reference; 0 if all
    weights are 0).

    Args:
      logits: [B, C] float logits of the main model.
      labels: [B] int class ids.
      bias_probs: [B, C] bias-only model probabilities; no gradient flows into
        them.

    Returns:
      A scalar.
    """
    bias_probs = jax.lax.stop_gradient(bias_probs.astype(jnp.float32))
    weights = 1.0 - _bias_prob_of_label(bias_probs, labels)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    )
    return jnp.sum(weights * losses) / jnp.maximum(jnp.sum(weights), 1e-12)


def confidence_regularization_loss(
    logits: jax.Array,
    labels: jax.Array,
    bias_probs: jax.Array,
    teacher_probs: jax.Array,
) -> jax.Array:
    """Confidence regularisation (Utama et al. 2020): distil a scaled teacher.

    ``s_i = 1 - p^b_{i,y_i}``; ``t~_ij = t_ij^{s_i} / sum_k t_ik^{s_i}``;
    returns ``mean_i -sum_j t~_ij log softmax(z_i)_j``. When the bias model is
    confident in the gold label, the teacher's targets are flattened towards
    uniform.

    Args:
      logits: [B, C] float logits of the main model.
      labels: [B] int class ids.
      bias_probs: [B, C] bias-only model probabilities; no gradient flows into
        them.
      teacher_probs: [B, C] probabilities of a standard fine-tuned teacher
        (rows sum to 1); no gradient flows into them.

    Returns:
      A scalar, the mean over the batch.
    """
    bias_probs = jax.lax.stop_gradient(bias_probs.astype(jnp.float32))
    teacher_probs = jax.lax.stop_gradient(teacher_probs.astype(jnp.float32))
    scale = 1.0 - _bias_prob_of_label(bias_probs, labels)
    # t ** s as in the reference (0 ** 0 == 1); targets are constants.
    scaled = jnp.power(teacher_probs, scale[:, None])
    targets = scaled / jnp.sum(scaled, axis=-1, keepdims=True)
    losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)
    return jnp.mean(losses)


KNOWN_BIAS_LOSSES: dict[str, Callable[..., jax.Array]] = {
    "poe": product_of_experts_loss,
    "reweighting": example_reweighting_loss,
    "conf_reg": confidence_regularization_loss,
}
"""Name -> loss. ``conf_reg`` also takes ``teacher_probs`` [B, C]."""


def get_known_bias_loss(name: str) -> Callable[..., jax.Array]:
    """Returns the known-bias loss registered under ``name``.

    Args:
      name: one of ``KNOWN_BIAS_LOSSES`` ("poe", "reweighting", "conf_reg").

    Raises:
      KeyError: for an unknown name, listing the valid ones.
    """
    try:
        return KNOWN_BIAS_LOSSES[name]
    except KeyError:
        raise KeyError(
            f"Unknown known-bias loss {name!r}; valid: {sorted(KNOWN_BIAS_LOSSES)}"
        ) from None
