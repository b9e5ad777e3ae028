"""moddiffy_jax.eval: metrics, attacker probes and the INLP baseline.

All of it works on plain arrays of representations ([N, H]) and labels
([N]); nothing here needs the encoder.

* :mod:`~moddiffy_jax.eval.metrics`: host-side task and fairness metrics.
* :mod:`~moddiffy_jax.eval.probes`: the paper's MLP-ensemble attacker (all
  seeds and members in one jitted program) and a linear probe.
* :mod:`~moddiffy_jax.eval.inlp`: iterative nullspace projection.
"""

from moddiffy_jax.eval.inlp import (
    INLPResult,
    apply_projection,
    fit_inlp,
    nullspace_projection,
)
from moddiffy_jax.eval.metrics import (
    accuracy,
    accuracy_from_confusion,
    balanced_accuracy,
    balanced_accuracy_from_confusion,
    bias_aligned_conflicting_accuracy,
    confusion_matrix,
    macro_f1,
    per_group_accuracy,
    rms_tpr_gap,
    task_report,
    tpr_gap,
)
from moddiffy_jax.eval.probes import (
    LinearProbeResult,
    ProbeConfig,
    ProbeResult,
    fit_logistic_regression,
    linear_probe,
    select_best_epoch,
    train_probe_ensemble,
)

__all__ = [
    "INLPResult",
    "LinearProbeResult",
    "ProbeConfig",
    "ProbeResult",
    "accuracy",
    "accuracy_from_confusion",
    "apply_projection",
    "balanced_accuracy",
    "balanced_accuracy_from_confusion",
    "bias_aligned_conflicting_accuracy",
    "confusion_matrix",
    "fit_inlp",
    "fit_logistic_regression",
    "linear_probe",
    "macro_f1",
    "nullspace_projection",
    "per_group_accuracy",
    "rms_tpr_gap",
    "select_best_epoch",
    "task_report",
    "tpr_gap",
    "train_probe_ensemble",
]
