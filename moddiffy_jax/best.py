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
    if rule == "best_dev" and not int(config.train.eval_every) > 0:
        raise ValueError(
            "config.train.select='best_dev' scores the model on dev every "
            "train.eval_every steps; set --config.train.eval_every (e.g. 50)."
        )


def full_row(rows: dict[str, Any]) -> str:
    """The composition row with the most exports applied (``core`` if none)."""
    return max(rows, key=lambda label: (label.count("+"), label))


class BestDev:
    """Keeps the best-scoring (trainable, frozen) state of a run.

    Args:
      workdir: the run directory (``best/state.msgpack`` is read from and
        written under it; only process 0 writes).
      enabled: False for ``train.select="last"`` (every call is a no-op).
      start: ``train.select_from``, the share of the last phase after which
        evaluations count (the SRNets reference: 0.7).
    """

    def __init__(self, workdir: Path, enabled: bool, start: float = 0.0):
        self.enabled = enabled
        self.start = float(start)
        self.path = Path(workdir) / "best" / "state.msgpack"
        self.info: dict[str, Any] | None = None
        self._state: Any = None  # state dict of {"trainable", "frozen"}

    def load(self) -> None:
        """Reads a best state an earlier attempt of this run wrote."""
        if not self.enabled or not self.path.is_file():
            return
        saved = flax.serialization.msgpack_restore(self.path.read_bytes())
        self.info = {
            "step": int(saved["step"]),
            "phase": str(saved["phase"]),
            "score": float(saved["score"]),
            "row": str(saved["row"]),
        }
        self._state = saved["state"]

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
        row = full_row(rows)
        score = float(rows[row]["dev_task_acc"])
        if self.info is not None and score <= self.info["score"]:
            if score < self.info["score"] or step >= self.info["step"]:
                return False
        state = flax.serialization.to_state_dict(
            jax.device_get({"trainable": trainable, "frozen": frozen})
        )
        self.info = {"step": step, "phase": phase, "score": score, "row": row}
        self._state = state
        if jax.process_index() == 0:
            blob = flax.serialization.msgpack_serialize({**self.info, "state": state})
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = temp_file_beside(self.path)
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        return True

    def restore(self, trainable, frozen) -> tuple[Any, Any, str] | None:
        """The best (trainable, frozen, phase) in the structure of the given
        state, or None when nothing was kept."""
        if not self.enabled or self._state is None:
            return None
        target = {"trainable": trainable, "frozen": frozen}
        state = flax.serialization.from_state_dict(target, self._state)
        return state["trainable"], state["frozen"], self.info["phase"]
