"""Losses as pure functions with named outputs."""

from moddiffy_jax.objectives.adversarial import (
    adversarial_loss,
    confusion_loss,
    gradient_reversal,
)
from moddiffy_jax.objectives.classification import (
    accuracy,
    cross_entropy,
    majority_vote,
)
from moddiffy_jax.objectives.counterfactual import (
    decision_moved,
    kl_where,
    outside,
    swap_invariance_loss,
    swap_table,
)
from moddiffy_jax.objectives.erasure import (
    TARGET_MODES,
    cell_offsets,
    class_means,
    erased_target_loss,
    fisher_loss,
    init_cell_means,
    init_mean_differences,
    offset_directions,
    overall_mean,
    pair_weights,
    update_cell_means,
)
from moddiffy_jax.objectives.known_bias import (
    KNOWN_BIAS_LOSSES,
    confidence_regularization_loss,
    example_reweighting_loss,
    get_known_bias_loss,
    product_of_experts_loss,
)
from moddiffy_jax.objectives.mmd import (
    effective_rows,
    init_covariance,
    kernel_matrix,
    mmd_loss,
    unbiased_mmd2,
    update_covariance,
    whiten,
    whitened_scale,
    whitening_map,
    within_group_scatter,
)
from moddiffy_jax.objectives.mutual_info import mutual_information
from moddiffy_jax.objectives.projection import task_projected

__all__ = [
    "KNOWN_BIAS_LOSSES",
    "accuracy",
    "adversarial_loss",
    "confidence_regularization_loss",
    "confusion_loss",
    "cross_entropy",
    "example_reweighting_loss",
    "get_known_bias_loss",
    "gradient_reversal",
    "task_projected",
    "decision_moved",
    "kl_where",
    "outside",
    "swap_invariance_loss",
    "swap_table",
    "majority_vote",
    "kernel_matrix",
    "mmd_loss",
    "mutual_information",
    "product_of_experts_loss",
    "unbiased_mmd2",
    "effective_rows",
    "init_covariance",
    "update_covariance",
    "whiten",
    "whitened_scale",
    "whitening_map",
    "within_group_scatter",
    "fisher_loss",
    "init_mean_differences",
    "pair_weights",
    "TARGET_MODES",
    "cell_offsets",
    "class_means",
    "offset_directions",
    "overall_mean",
    "erased_target_loss",
    "init_cell_means",
    "update_cell_means",
]
