"""Best-dev selection: export the state that scored best on dev, not the last.

``config.train.select``:

- ``"last"`` (default): the run exports what it has after its last step.
- ``"best_dev"``: at every in-run evaluation (``train.eval_every`` steps,
  each phase's end and right after a phase change) the run scores the dev
  task accuracy of its *full* composition (the core with every export
  applied: ``core+mask`` for SRNets, ``core+gender+age`` for two diffs,
  ``core`` for methods without exports) and keeps the best state; the export
  and the final evaluation use it. Only evaluations in the run's last phase
  count (a diff run's fixmask phase, never its dense L0 phase), so the
  export keeps the final phase's form and budget, and only from
  ``train.select_from`` (a share of that phase's steps, default 0) on. The
  SRNets reference selects its masks this way from 70% of training on
  (spec A3.1): ``--config.train.select=best_dev --config.train.eval_every=50
  --config.train.select_from=0.7``. Ties keep the earlier step.

``config.train.select_scope`` (``best_dev`` only) says what is chosen:

- ``"run"`` (default): one state of the whole run, scored on its full
  composition.
- ``"diff"``: each attribute's diff on its own, at the evaluation where
  ``core+<attribute>`` scored best, for runs whose diffs train apart on a
  frozen core (MoDDiffy-post): the diffs share nothing, so each can stop
  where it was best. A diff that breaks down late (the adversarial gender
  diff of stop 63, 0.91 on dev at step 200 and 0.58 at 225, while the full
  composition still read 0.90) is then exported before its breakdown,
  which the full composition's score does not see. MoDDiffy-par's diffs
  are changes of the core of their own step and cannot be chosen apart.

``config.train.select_metric`` (``best_dev`` only) says what "best" is:

- ``"task"`` (default): the full composition's dev task accuracy.
- ``"task_minus_leakage"``: that accuracy minus ``train.select_leakage_weight``
  (default 1) times the mean, over the protected attributes, of each
  attribute's dev leakage: the balanced accuracy of a fresh class-balanced
  linear probe fit on train representations (``eval.probe_max_train`` rows)
  of the configuration that should not carry it, ``core+<attribute>`` where
  the run exports a diff per attribute, else the full composition. One point
  of leakage costs as much as one point of task accuracy at weight 1; the
  score is a fixed function of each evaluation, so a resumed run keeps the
  same state as an uninterrupted one. The probes run at every evaluation
  (``eval.probe_during`` is implied) and are written to the metrics.

The kept state is written to ``WORKDIR/best/state.msgpack`` (one file,
replaced atomically, with its step, phase and score), so a resumed run
selects exactly what the uninterrupted one does: the best is a maximum over
the same evaluations, and the earliest of equal scores wins either way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import ml_collections

from moddiffy_jax._files import temp_file_beside

SELECT_RULES = ("last", "best_dev")
SELECT_METRICS = ("task", "task_minus_leakage")
SELECT_SCOPES = ("run", "diff")
#: Methods whose diffs train apart on a frozen core (select_scope="diff").
DIFF_SCOPE_METHODS = ("moddiffy_post",)


def leakage_key(attribute: str) -> str:
    """The field of a composition row holding its fresh dev leakage."""
    return f"dev_leakage/{attribute}"


def uses_leakage(config: ml_collections.ConfigDict) -> bool:
    """Whether best-dev selection needs fresh probes at every evaluation."""
    train = config.train
    return (
        train.get("select", "last") == "best_dev"
        and train.get("select_metric", "task") == "task_minus_leakage"
    )


def check_select(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the field and the fix."""
    rule = config.train.get("select", "last")
    if rule not in SELECT_RULES:
        raise ValueError(
            f"config.train.select={rule!r}; use one of {list(SELECT_RULES)}."
        )
    start = config.train.get("select_from", 0.0)
    if not 0.0 <= float(start) <= 1.0:
        raise ValueError(
            f"config.train.select_from={start!r} is a share of the last phase's "
            "steps; use a number in [0, 1] (the SRNets reference: 0.7)."
        )
    metric = config.train.get("select_metric", "task")
    if metric not in SELECT_METRICS:
        raise ValueError(
            f"config.train.select_metric={metric!r}; use one of {list(SELECT_METRICS)}."
        )
    weight = config.train.get("select_leakage_weight", 1.0)
    if not float(weight) >= 0.0:
        raise ValueError(
            f"config.train.select_leakage_weight={weight!r} is what one point of "
            "leakage costs in points of task accuracy; use a number >= 0 (e.g. 1)."
        )
    scope = config.train.get("select_scope", "run")
    if scope not in SELECT_SCOPES:
        raise ValueError(
            f"config.train.select_scope={scope!r}; use one of {list(SELECT_SCOPES)}."
        )
    method = config.get("method", {}).get("name")
    if rule == "best_dev" and scope == "diff" and method not in DIFF_SCOPE_METHODS:
        raise ValueError(
            f"config.train.select_scope='diff' chooses each diff at its own "
            f"best step, which needs diffs trained apart on a frozen core "
            f"({list(DIFF_SCOPE_METHODS)}); {method!r} exports one state. Use "
            "select_scope='run'."
        )
    if rule == "best_dev" and not int(config.train.eval_every) > 0:
        raise ValueError(
            "config.train.select='best_dev' scores the model on dev every "
            "train.eval_every steps; set --config.train.eval_every (e.g. 50)."
        )


def full_row(rows: dict[str, Any]) -> str:
    """The composition row with the most exports applied (``core`` if none)."""
    return max(rows, key=lambda label: (label.count("+"), label))


def leakage_row(rows: dict[str, Any], attribute: str) -> str:
    """The row that should not carry ``attribute``: its own diff's
    (``core+<attribute>``) where there is one, else the full composition."""
    own = f"core+{attribute}"
    return own if own in rows else full_row(rows)


def _check_attributes(metric: str, attributes: tuple[str, ...]) -> None:
    if metric == "task_minus_leakage" and not attributes:
        raise ValueError(
            "train.select_metric='task_minus_leakage' needs protected attributes "
            "(config.data.attributes); use select_metric='task' for this run."
        )


def score(
    rows: dict[str, Any],
    metric: str = "task",
    attributes: tuple[str, ...] = (),
    leakage_weight: float = 1.0,
) -> tuple[float, str]:
    """(score, row) of one evaluation's composition rows under ``metric``.

    ``rows`` map a label to its fields (``dev_task_acc``, and for
    ``task_minus_leakage`` each attribute's ``dev_leakage/<attribute>`` on the
    rows :func:`leakage_row` names).
    """
    row = full_row(rows)
    value = float(rows[row]["dev_task_acc"])
    if metric == "task":
        return value, row
    _check_attributes(metric, attributes)
    leaks = []
    for a in attributes:
        fields = rows[leakage_row(rows, a)]
        if leakage_key(a) not in fields:
            raise ValueError(
                f"no dev leakage of {a!r} in row {leakage_row(rows, a)!r} at this "
                "evaluation (the probes did not run)."
            )
        leaks.append(float(fields[leakage_key(a)]))
    return value - leakage_weight * sum(leaks) / len(leaks), row


class BestDev:
    """Keeps the best-scoring (trainable, frozen) state of a run.

    Args:
      workdir: the run directory (``best/state.msgpack`` is read from and
        written under it; only process 0 writes).
      enabled: False for ``train.select="last"`` (every call is a no-op).
      start: ``train.select_from``, the share of the last phase after which
        evaluations count (the SRNets reference: 0.7).
      metric: ``train.select_metric`` (see :func:`score`).
      attributes: the protected attributes (``task_minus_leakage``).
      leakage_weight: ``train.select_leakage_weight``.
    """

    def __init__(
        self,
        workdir: Path,
        enabled: bool,
        start: float = 0.0,
        metric: str = "task",
        attributes: tuple[str, ...] = (),
        leakage_weight: float = 1.0,
    ):
        if enabled:
            _check_attributes(metric, attributes)
        self.enabled = enabled
        self.start = float(start)
        self.metric = metric
        self.attributes = tuple(attributes)
        self.leakage_weight = float(leakage_weight)
        self.path = Path(workdir) / "best" / "state.msgpack"
        self.scope = "run"
        self.info: dict[str, Any] | None = None
        self._state: Any = None  # state dict of {"trainable", "frozen"}

    def load(self) -> None:
        """Reads a best state an earlier attempt of this run wrote."""
        if not self.enabled or not self.path.is_file():
            return
        saved = flax.serialization.msgpack_restore(self.path.read_bytes())
        self._check_saved(saved)
        self.info = {
            "step": int(saved["step"]),
            "phase": str(saved["phase"]),
            "score": float(saved["score"]),
            "row": str(saved["row"]),
            "metric": str(saved.get("metric", "task")),
        }
        self._state = saved["state"]

    def _check_saved(self, saved: dict[str, Any]) -> None:
        scope = str(saved.get("scope", "run"))
        if scope != self.scope:
            raise ValueError(
                f"{self.path} was selected with train.select_scope={scope!r}, "
                f"this run asks for {self.scope!r}. Resume with the first run's "
                "select_scope, or start a new workdir."
            )
        if str(saved.get("metric", "task")) != self.metric:
            raise ValueError(
                f"{self.path} was selected by train.select_metric="
                f"{str(saved.get('metric', 'task'))!r}, this run asks for "
                f"{self.metric!r}: the scores do not compare. Resume with the "
                "first run's select_metric, or start a new workdir."
            )

    def offer(
        self,
        rows: dict[str, Any],
        trainable,
        frozen,
        phase: str,
        step: int,
        progress: float,
    ) -> bool:
        """Keeps this state if its dev score beats the best; returns whether.

        ``progress``: the share of the phase's steps done; evaluations before
        ``start`` (``train.select_from``) do not count.
        """
        if not self.enabled or progress < self.start:
            return False
        value, row = score(rows, self.metric, self.attributes, self.leakage_weight)
        if self.info is not None and value <= self.info["score"]:
            if value < self.info["score"] or step >= self.info["step"]:
                return False
        state = flax.serialization.to_state_dict(
            jax.device_get({"trainable": trainable, "frozen": frozen})
        )
        self.info = {
            "step": step,
            "phase": phase,
            "score": value,
            "row": row,
            "metric": self.metric,
        }
        self._state = state
        self._save({**self.info, "state": state})
        return True

    def _save(self, record: dict[str, Any]) -> None:
        """Writes ``record`` to ``best/state.msgpack`` (process 0; atomic)."""
        if jax.process_index() != 0:
            return
        blob = flax.serialization.msgpack_serialize(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_file_beside(self.path)
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def restore(self, trainable, frozen) -> tuple[Any, Any, str] | None:
        """The best (trainable, frozen, phase) in the structure of the given
        state, or None when nothing was kept."""
        if not self.enabled or self._state is None:
            return None
        target = {"trainable": trainable, "frozen": frozen}
        state = flax.serialization.from_state_dict(target, self._state)
        return state["trainable"], state["frozen"], self.info["phase"]


def diff_score(
    rows: dict[str, Any],
    attribute: str,
    metric: str = "task",
    leakage_weight: float = 1.0,
) -> tuple[float, str]:
    """(score, row) of ``attribute``'s own diff at one evaluation: the dev task
    accuracy of ``core+<attribute>`` (``task_minus_leakage``: minus
    ``leakage_weight`` times that row's fresh dev leakage of the attribute)."""
    row = f"core+{attribute}"
    if row not in rows:
        raise ValueError(
            f"train.select_scope='diff' scores each diff on its own row; this "
            f"evaluation has no {row!r} (rows: {sorted(rows)})."
        )
    value = float(rows[row]["dev_task_acc"])
    if metric == "task":
        return value, row
    fields = rows[row]
    if leakage_key(attribute) not in fields:
        raise ValueError(
            f"no dev leakage of {attribute!r} in row {row!r} at this "
            "evaluation (the probes did not run)."
        )
    return value - leakage_weight * float(fields[leakage_key(attribute)]), row


class BestDiffs(BestDev):
    """``train.select_scope="diff"``: each attribute's diff kept at its own
    best evaluation (:func:`diff_score`); the rest of the state is the last
    step's. For diffs trained apart on a frozen core (MoDDiffy-post): there
    each diff is its own module, the same whichever step the others stop at.

    ``info`` (results.json's ``selected``): the metric, the phase and, under
    ``diffs``, each attribute's step, score and row. Ties keep the earlier
    step; a resumed run keeps what an uninterrupted one does (the file holds
    every diff's best so far).
    """

    def __init__(self, workdir: Path, enabled: bool, **kw: Any):
        super().__init__(workdir, enabled, **kw)
        self.scope = "diff"
        self._kept: dict[str, dict[str, Any]] = {}  # attribute -> info, state

    def _refresh_info(self, phase: str) -> None:
        self.info = {
            "scope": "diff",
            "metric": self.metric,
            "phase": phase,
            "diffs": {a: dict(k["info"]) for a, k in sorted(self._kept.items())},
        }

    def load(self) -> None:
        if not self.enabled or not self.path.is_file():
            return
        saved = flax.serialization.msgpack_restore(self.path.read_bytes())
        self._check_saved(saved)
        self._kept = {
            str(a): {
                "info": {
                    "step": int(k["step"]),
                    "score": float(k["score"]),
                    "row": str(k["row"]),
                },
                "state": k["state"],
            }
            for a, k in saved["diffs"].items()
        }
        self._refresh_info(str(saved["phase"]))

    def offer(self, rows, trainable, frozen, phase, step, progress) -> bool:
        """Keeps each attribute's diff where its own row beats its best;
        returns whether any was kept."""
        if not self.enabled or progress < self.start:
            return False
        changed = False
        for a in self.attributes:
            value, row = diff_score(rows, a, self.metric, self.leakage_weight)
            kept = self._kept.get(a)
            if kept is not None and value <= kept["info"]["score"]:
                if value < kept["info"]["score"] or step >= kept["info"]["step"]:
                    continue
            diff = jax.device_get(trainable["diffs"][a])
            self._kept[a] = {
                "info": {"step": step, "score": value, "row": row},
                "state": flax.serialization.to_state_dict(diff),
            }
            changed = True
        if changed:
            self._refresh_info(phase)
            self._save(
                {
                    "scope": "diff",
                    "metric": self.metric,
                    "phase": phase,
                    "diffs": {
                        a: {**k["info"], "state": k["state"]}
                        for a, k in self._kept.items()
                    },
                }
            )
        return changed

    def restore(self, trainable, frozen) -> tuple[Any, Any, str] | None:
        """The last state with each kept diff put back; None when none was."""
        if not self.enabled or not self._kept:
            return None
        diffs = dict(trainable["diffs"])
        for a, kept in self._kept.items():
            diffs[a] = flax.serialization.from_state_dict(diffs[a], kept["state"])
        return {**trainable, "diffs": diffs}, frozen, self.info["phase"]


def keeper(workdir: Path, config: ml_collections.ConfigDict, attributes) -> BestDev:
    """The run's :class:`BestDev` (or :class:`BestDiffs`) from its config."""
    train = config.train
    kind = BestDiffs if train.get("select_scope", "run") == "diff" else BestDev
    return kind(
        workdir,
        train.get("select", "last") == "best_dev",
        start=train.get("select_from", 0.0),
        metric=train.get("select_metric", "task"),
        attributes=tuple(attributes),
        leakage_weight=train.get("select_leakage_weight", 1.0),
    )
