"""The FFW surgeon: the jitted pieces of one surgery, bound to its model,
data and config (gate step, bias-head epochs, features, gating and pruning,
leakage and task reports). :mod:`moddiffy_jax.surgery` drives it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moddiffy_jax.data import model_inputs
from moddiffy_jax.eval import metrics as metrics_lib
from moddiffy_jax.eval.forward import Forward
from moddiffy_jax.methods.ffw import (
    PlateauState,
    batched_mutual_information,
    bias_logits,
    default_ffw_config,
    epoch_batches,
    gate_followers,
    gate_selection,
    make_gate_optimizer,
    make_gate_step,
    make_ph_epoch,
    make_ph_optimizer,
    pad_rows,
    step_plateau,
    to_float,
)
from moddiffy_jax.subnets import gates as gates_lib

PyTree = Any


class Surgeon:
    """Holds the context, the frozen base and the compiled pieces of one run."""

    def __init__(self, config: ml_collections.ConfigDict, ctx: Any, core, head):
        self.config = config
        self.cfg = config.ffw if "ffw" in config else default_ffw_config()
        cfg = self.cfg
        self.ctx = ctx
        self.model = model = ctx.model
        # On device once: the jitted steps take the frozen base as an argument.
        self.base = jax.tree.map(jnp.asarray, {"encoder": core, "task_head": head})
        self.attributes = tuple(cfg.attributes) or tuple(ctx.attributes)
        attr_classes = {a: len(ctx.data.attr_classes[a]) for a in self.attributes}
        self.attr_classes = attr_classes
        self.num_task_classes = len(ctx.data.task_classes)
        if cfg.conflicting:
            bad = [a for a, n in attr_classes.items() if n != self.num_task_classes]
            if bad:
                raise ValueError(
                    f"ffw.conflicting needs bias attributes with the task's "
                    f"{self.num_task_classes} classes; {bad} differ. Set "
                    "config.ffw.conflicting=False."
                )
        self.splits = {k: cfg.splits[k] for k in ("gate_train", "gate_val", "test")}
        missing = [s for s in self.splits.values() if s not in ctx.data.splits]
        if missing:
            raise ValueError(
                f"config.ffw.splits names {missing}; the dataset has "
                f"{sorted(ctx.data.splits)}."
            )
        self.include, self.exclude, self.paths = gate_selection(cfg, model, core, head)
        rules = [re.escape(p) for p in self.paths]
        self.init_logits = gates_lib.init_gates(
            self.base,
            rules,
            structured=cfg.structured,
            init=float(cfg.get("init_logit", 0.0)),
        ).logits
        self.followers = (
            gate_followers(model, core, head, self.paths) if cfg.structured else {}
        )
        followers = self.followers
        if cfg.structured:

            def apply_fn(base, logits, t):
                return gates_lib.apply_structured_gates(
                    base,
                    gates_lib.GateState(logits),
                    temperature=t,
                    followers=followers,
                )

            def prune_fn(base, logits):
                return gates_lib.apply_structured_pruning(
                    base, gates_lib.GateState(logits), followers=followers
                )

        else:

            def apply_fn(base, logits, t):
                return gates_lib.apply_gates(
                    base, gates_lib.GateState(logits), temperature=t
                )

            def prune_fn(base, logits):
                return gates_lib.apply_pruning(base, gates_lib.GateState(logits))

        self.gate_opt = make_gate_optimizer(cfg)
        self.ph_opt = make_ph_optimizer(cfg)
        self.apply = jax.jit(apply_fn)
        self.prune = jax.jit(prune_fn)
        self.gate_step = jax.jit(
            make_gate_step(
                model=model,
                apply_fn=apply_fn,
                gate_opt=self.gate_opt,
                ph_opt=self.ph_opt,
                alpha=cfg.alpha,
                gamma=cfg.gamma,
                attr_classes=attr_classes,
            ),
            donate_argnums=(0,),
        )
        self.ph_epoch = jax.jit(make_ph_epoch(self.ph_opt))

        self.forward = Forward(model, config.eval.batch_size)
        self.mi_fns = {
            a: jax.jit(
                lambda y, p, w, n=n: batched_mutual_information(y, p, w, num_classes=n)
            )
            for a, n in attr_classes.items()
        }
        self._labels: dict[str, dict[str, np.ndarray]] = {}

    # -- data ---------------------------------------------------------------

    def seed_words(self, *tags: int) -> tuple[int, ...]:
        return (int(self.config.seed), *(int(t) for t in tags))

    def batch_arrays(self, batch: Mapping[str, Any], weight: np.ndarray):
        inputs = model_inputs(batch)
        task = np.asarray(batch["task"], np.int32)
        bias = {a: np.asarray(batch["attrs"][a], np.int32) for a in self.attributes}
        return inputs, task, bias, np.asarray(weight, np.float32)

    def feature_dim(self) -> int:
        split = self.ctx.data.splits[self.splits["gate_train"]]
        batch = split.take(np.zeros(1, np.int64))
        h = jax.eval_shape(
            self.forward.encode, self.base["encoder"], model_inputs(batch)
        )
        return int(h.shape[-1])

    def features(
        self, params: PyTree, split_name: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Features [N, H] and task logits [N, C] of a split (in order)."""
        from moddiffy_jax.data import eval_batches

        split = self.ctx.data.splits[split_name]
        n = len(split)
        hs, logits = [], []
        labels = {"task": []} | {a: [] for a in self.attributes}
        for batch in eval_batches(split, self.config.eval.batch_size):
            h = self.forward.encode(params["encoder"], model_inputs(batch))
            lg = self.forward.head(params["task_head"], h)
            hs.append(h)
            logits.append(lg)
            if split_name not in self._labels:
                labels["task"].append(np.asarray(batch["task"]))
                for a in self.attributes:
                    labels[a].append(np.asarray(batch["attrs"][a]))
        if split_name not in self._labels:
            self._labels[split_name] = {
                k: np.concatenate(v)[:n].astype(np.int32) for k, v in labels.items()
            }
        h = np.concatenate(jax.device_get(hs))[:n]
        return h, np.concatenate(jax.device_get(logits))[:n]

    def labels(self, split_name: str) -> dict[str, np.ndarray]:
        if split_name not in self._labels:
            self.features(self.base, split_name)
        return self._labels[split_name]

    # -- PH -------------------------------------------------------------------

    def train_ph(
        self, ph: PyTree, opt_state: PyTree, feats: np.ndarray, tags: Sequence[int]
    ) -> tuple[PyTree, PyTree, int]:
        """Trains the PH on cached gate-train features until the CE plateaus."""
        cfg = self.cfg
        labels = self.labels(self.splits["gate_train"])
        bias = {a: jnp.asarray(labels[a]) for a in self.attributes}
        feats = jnp.asarray(feats)
        plateau = PlateauState()
        epochs = 0
        for e in range(cfg.ph_max_epochs):
            idx, w = epoch_batches(
                len(feats), cfg.batch_size, self.seed_words(*tags, e)
            )
            ph, opt_state, loss = self.ph_epoch(ph, opt_state, feats, bias, idx, w)
            epochs = e + 1
            plateau = step_plateau(plateau, to_float(loss), threshold=cfg.ph_threshold)
            if plateau.num_bad > cfg.ph_patience:
                break
        return ph, opt_state, epochs

    def fresh_ph(self, ph0: PyTree, feats: np.ndarray, tags: Sequence[int]):
        ph = jax.tree.map(jnp.copy, ph0)
        ph, _, epochs = self.train_ph(ph, self.ph_opt.init(ph), feats, tags)
        return ph, epochs

    def leakage(self, ph: PyTree, feats: np.ndarray, split_name: str) -> dict[str, Any]:
        """MI (per-batch plug-in, bias labels) and bias accuracy of ``ph``."""
        labels = self.labels(split_name)
        idx, w = pad_rows(np.arange(len(feats)), self.cfg.batch_size)
        out: dict[str, Any] = {"mi": {}, "bias_acc": {}}
        for a in self.attributes:
            logits = np.asarray(bias_logits(ph[a], jnp.asarray(feats)))
            probs = np.asarray(jax.nn.softmax(logits))
            mi, sizes = self.mi_fns[a](labels[a][idx], probs[idx], w)
            mi, sizes = np.asarray(mi, np.float64), np.asarray(sizes, np.float64)
            out["mi"][a] = float(np.sum(mi * sizes) / np.sum(sizes))
            out["bias_acc"][a] = metrics_lib.accuracy(labels[a], logits.argmax(-1))
        out["mean_mi"] = float(np.mean(list(out["mi"].values())))
        out["mean_bias_acc"] = float(np.mean(list(out["bias_acc"].values())))
        return out

    def task_report(self, logits: np.ndarray, split_name: str) -> dict[str, float]:
        """Task accuracy, group-mean ("unbiased") and bias-conflicting accuracy."""
        labels = self.labels(split_name)
        y, pred = labels["task"], logits.argmax(-1)
        report = {"accuracy": metrics_lib.accuracy(y, pred)}
        for a in self.attributes:
            b = labels[a]
            cells = [
                float(np.mean(pred[m] == y[m]))
                for m in (
                    (y == c) & (b == g) for c in np.unique(y) for g in np.unique(b)
                )
                if m.any()
            ]
            report[f"{a}/unbiased_accuracy"] = float(np.mean(cells))
            if self.cfg.conflicting:
                acc = metrics_lib.bias_aligned_conflicting_accuracy(y, pred, b == y)
                report[f"{a}/aligned_accuracy"] = acc["aligned"]
                report[f"{a}/conflicting_accuracy"] = acc["conflicting"]
        return report

    def evaluate(
        self, params: PyTree, ph0: PyTree, tags: Sequence[int] | None
    ) -> dict[str, Any]:
        """Task metrics on gate-val and test, and the leakage of a fresh PH.

        ``tags=None`` evaluates ``ph0`` itself (the vanilla model's PH0);
        otherwise a copy of ``ph0`` is trained to a plateau on ``params``.
        """
        out: dict[str, Any] = {"eval": {}}
        feats = {}
        for key in ("gate_val", "test"):
            name = self.splits[key]
            if name not in feats:
                feats[name], logits = self.features(params, name)
                out["eval"][name] = self.task_report(logits, name)
        ph, epochs = ph0, 0
        if tags is not None:
            train_feats, _ = self.features(params, self.splits["gate_train"])
            ph, epochs = self.fresh_ph(ph0, train_feats, tags)
        val = self.splits["gate_val"]
        out["leakage"] = self.leakage(ph, feats[val], val)
        out["leakage"]["ph_epochs"] = epochs
        return out
