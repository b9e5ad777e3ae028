"""The one jitted evaluation forward of the library.

CLS representations and task logits of any encoder params, deterministic (no
dropout), batch by batch over a split. The Evaluator (task accuracy of a
composition), the leakage probes and the composition table, the in-loop dev
probes, FFW surgery's features and the conf_reg teacher all read the model
through it, so there is one compiled encoder forward per model and batch
shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax.data import model_inputs


class Forward:
    """Jitted ``encode(params, inputs) -> h`` and ``head(head, h) -> logits``.

    Args:
      model: a text or vision model with ``represent(params, inputs, rng,
        train)`` and ``task_logits(head, h, rng, train)``.
      batch_size: rows per evaluation batch (the last batch is padded and
        its padding dropped from every result).
    """

    def __init__(self, model: Any, batch_size: int):
        self.model = model
        self.batch_size = int(batch_size)
        self.encode = jax.jit(
            lambda params, inputs: model.represent(params, inputs, None, False)
        )
        self.head = jax.jit(lambda head, h: model.task_logits(head, h, None, False))

    def batches(self, split: Any) -> Iterator[tuple[dict, np.ndarray]]:
        """``(model inputs, real-row mask)`` per evaluation batch of a split."""
        from moddiffy_jax.data import eval_batches

        for batch in eval_batches(split, self.batch_size):
            yield model_inputs(batch), np.asarray(batch["weight"]) > 0

    def logits(self, params: Any, head: Any, inputs: Any) -> jax.Array:
        """Task logits [B, C] of one batch of model inputs."""
        return self.head(head, self.encode(params, inputs))

    def represent_split(self, params: Any, split: Any) -> np.ndarray:
        """CLS representations [N, H] of a split (e.g. a TokenizedSplit or an
        OOD set), in row order."""
        out = [
            np.asarray(self.encode(params, inputs))[real]
            for inputs, real in self.batches(split)
        ]
        return np.concatenate(out)

    def logits_split(self, params: Any, head: Any, split: Any) -> np.ndarray:
        """Task logits [N, C] of a split, in row order."""
        out = [
            np.asarray(self.logits(params, head, inputs))[real]
            for inputs, real in self.batches(split)
        ]
        return np.concatenate(out)

    def predict(self, head: Any, h: np.ndarray) -> np.ndarray:
        """Task predictions (int [N]) from representations ``h`` [N, H]."""
        return np.asarray(jnp.argmax(self.head(head, jnp.asarray(h)), -1))


class Representer(Forward):
    """The forward over a run's named splits (``ctx.data.splits``)."""

    def __init__(self, ctx: Any, batch_size: int):
        super().__init__(ctx.model, batch_size)
        self.ctx = ctx

    def represent(self, params: Any, split: str) -> np.ndarray:
        """CLS representations [N, H] of the run's split named ``split``."""
        return self.represent_split(params, self.ctx.data.splits[split])
