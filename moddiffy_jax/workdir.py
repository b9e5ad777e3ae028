"""A run directory: the config guard, the metrics writer, the preemption signal.

``prepare_workdir`` refuses a directory that holds a run of another config;
``MetricWriter`` appends JSON lines (and TensorBoard scalars) on process 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_collections

from moddiffy_jax import checkpoints

# Config keys whose change does not make a different run (how long to log,
# where to stop for a simulated preemption, ...).
_VOLATILE_KEYS = ("train.stop_at_step", "train.log_every", "train.progress")


def _flat_config(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_config(v, key + "."))
        else:
            out[key] = v
    return out


def config_to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """A JSON-able dict of the resolved config (tuples become lists)."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


def prepare_workdir(config: ml_collections.ConfigDict, workdir: Path) -> None:
    """Creates ``workdir`` or checks it holds a run of the same config.

    Raises:
      ValueError: if ``workdir`` holds a run with a different config; nothing
        in it is touched.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.json"
    new = config_to_dict(config)
    if path.exists():
        old = json.loads(path.read_text())
        a, b = _flat_config(old), _flat_config(new)
        changed = sorted(
            k
            for k in set(a) | set(b)
            if a.get(k) != b.get(k) and k not in _VOLATILE_KEYS
        )
        if changed:
            details = ", ".join(
                f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:8]
            )
            raise ValueError(
                f"{workdir} already holds a run with a different config ({details}). "
                "Use a new --workdir, or delete this one if you no longer need it."
            )
    if jax.process_index() == 0:
        checkpoints.write_json_atomic(path, new)


class MetricWriter:
    """JSON lines plus TensorBoard scalars under the run directory."""

    def __init__(self, workdir: Path):
        self.path = workdir / "metrics.jsonl"
        self.tb = None
        if jax.process_index() != 0:
            return
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(workdir / "tb"))
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            self.tb = None

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        if jax.process_index() != 0:
            return
        record = {"step": int(step), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class Preempted(RuntimeError):
    """Raised when ``config.train.stop_at_step`` simulates a preemption."""

    def __init__(self, step: int):
        super().__init__(f"Stopped at step {step} (config.train.stop_at_step).")
        self.step = step


def progress_bar(config, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=config.method.name,
        disable=not config.train.progress,
        dynamic_ncols=True,
    )
