"""The composition matrix of a run: task metrics and leakage for every subset.

``evaluate_run(workdir)`` reads only what a run directory holds (config.json,
``export/core.safetensors``, ``export/task_head.safetensors``,
``export/diffs/*.safetensors``) and evaluates:

* the core alone, each attribute diff, every pair, ..., all diffs (optionally
  each diff scaled by a weight); DiffPrun's task diff is part of the model and
  is always applied;
* INLP (Ravfogel et al. 2020) per attribute on the core's representations,
  as a post-hoc baseline;
* two task-only references (``task_only``, :mod:`moddiffy_jax.eval.bottleneck`):
  ``core decision``, the core head's logits probed as the representation
  (what the core's own decision carries of each attribute), and
  ``core+bottleneck``, the CLS vector cut to the ``K`` coordinates
  the head reads most (a last-LayerNorm diff plus a head refit on train),
  the smallest ``K`` within ``max_drop`` of the core's dev accuracy.
* the attribute-penalized task discriminant (``discriminant``,
  :mod:`moddiffy_jax.eval.discriminant`): ``core+discriminant(<attribute>)``
  per attribute and all attributes together, the core's CLS vector projected
  onto the task's ``C - 1`` discriminant directions penalized for each
  attribute's within-class mean shifts; with ``weights`` written into a
  sparse diff of the core's last layer (:mod:`moddiffy_jax.eval.discriminant_diff`)
  and read from the encoder with it added; each fit and diff saved to
  ``eval/discriminant/``).

For each configuration: task accuracy, macro-F1, balanced accuracy and
per-group fairness metrics (TPR gap RMS) of the run's own task head, and, for
every protected attribute, the leakage: the paper's probe ensemble trained on
frozen CLS representations (mean and std over seeds of the balanced accuracy)
and a linear probe. Results go to ``workdir/eval/results.json`` and a
Markdown report ``workdir/eval/report.md``.

Known-bias runs (SRNets) add, per configuration:

* ``{split}_bias_aligned_acc`` / ``{split}_bias_conflicting_acc`` when the
  splits carry ``extras["bias_logprobs"]`` (``data.bias``): accuracy on the
  examples whose bias-model argmax is / is not the gold label;
* ``ood: {name: metrics}`` for every enabled entry of ``config.eval.ood``
  (HANS, PAWS, FEVER-Symmetric; :mod:`moddiffy_jax.eval.ood`).

:func:`ood_and_bias_rows` computes just these two for any ``predict``
callable, so the training loop can report them without the probes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from moddiffy_jax import checkpoints
from moddiffy_jax._files import jsonable
from moddiffy_jax.eval import bottleneck as bottleneck_lib
from moddiffy_jax.eval import discriminant as discriminant_lib
from moddiffy_jax.eval import discriminant_diff
from moddiffy_jax.eval import inlp as inlp_lib
from moddiffy_jax.eval import metrics as metrics_lib
from moddiffy_jax.eval import ood as ood_lib
from moddiffy_jax.eval import probes as probes_lib
from moddiffy_jax.eval.bias_rows import (  # noqa: F401  (also this module's API)
    _aligned_mask,
    bias_split_metrics,
    load_run_ood_sets,
    ood_and_bias_rows,
)
from moddiffy_jax.eval.evaluator import Evaluator, compositions
from moddiffy_jax.eval.forward import Representer  # noqa: F401
from moddiffy_jax.eval.removal import leakage_floors  # noqa: F401
from moddiffy_jax.eval.report import format_report, gap_closed  # noqa: F401
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets.sparse_diff import fingerprint

SPLITS = ("train", "dev", "test")
#: A task head predicting one class for at least this share of a split is
#: reported as degenerate (a constant predictor).
DEGENERATE_SHARE = 0.99


def load_run_config(workdir: str | Path) -> ml_collections.ConfigDict:
    """The config a run was trained with (its ``config.json``)."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {workdir} is not a run directory of this library "
            "(train one with python -m moddiffy_jax.main)."
        )
    return ml_collections.ConfigDict(json.loads(path.read_text()))


@dataclasses.dataclass
class RunArtifacts:
    """What evaluation needs from a finished run, checked for consistency."""

    core: Any
    head: Any
    diffs: dict[str, diffs_lib.SparseDiff]
    #: Corrections of compositions (``gender+age``; methods/joint_erasure.py).
    joint: dict[str, diffs_lib.SparseDiff] = dataclasses.field(default_factory=dict)

    @property
    def attribute_diffs(self) -> list[str]:
        return [n for n in self.diffs if n != "task"]


def load_artifacts(workdir: str | Path) -> RunArtifacts:
    """Core, task head and diffs of a run; diffs are checked against the core.

    Raises:
      FileNotFoundError: a missing export (an unfinished or partial run);
        ``export.IncompleteExport`` when its manifest is missing or a file
        differs from it.
      ValueError: a diff trained on another base (fingerprint or shapes).
    """
    from moddiffy_jax.manifest import verify_export

    export = Path(workdir) / "export"
    for name in ("core.safetensors", "task_head.safetensors"):
        if not (export / name).is_file():
            raise FileNotFoundError(
                f"{export / name} is missing: the run in {workdir} has not finished "
                "(re-run its training command to resume it) or was not trained here."
            )
    verify_export(export)  # refuses a half-written or changed export
    core, _ = checkpoints.load_params(export / "core.safetensors")
    head, _ = checkpoints.load_params(export / "task_head.safetensors")
    diffs = {}
    for path in sorted((export / "diffs").glob("*.safetensors")):
        # A diff from another base is refused here with a message naming both
        # fingerprints.
        diffs[path.stem] = diffs_lib.load_sparse_diff(path, base=core)
    joint = {
        path.stem: diffs_lib.load_sparse_diff(path, base=core)
        for path in sorted((export / "joint").glob("*.safetensors"))
    }
    return RunArtifacts(core=core, head=head, diffs=diffs, joint=joint)


def _task_metrics(ctx, rep: Representer, head, reps, splits) -> dict[str, Any]:
    out = {}
    attrs = list(ctx.data.attr_classes)
    for split in splits:
        data = ctx.data.splits[split]
        pred = rep.predict(head, reps[split])
        report = metrics_lib.task_report(
            data.task,
            pred,
            num_classes=len(ctx.data.task_classes),
            attrs={a: data.attrs[a] for a in attrs},
            attr_num_classes={a: len(ctx.data.attr_classes[a]) for a in attrs},
            aligned=_aligned_mask(data),
        )
        # A (near-)constant predictor can score a small TPR gap without
        # doing anything: flag it instead of reporting it as fair.
        share = np.bincount(pred, minlength=len(ctx.data.task_classes)) / max(
            len(pred), 1
        )
        report["degenerate"] = bool(share.max() >= DEGENERATE_SHARE)
        out[split] = report
    return out


#: Why the ``core decision`` row has no attacker reading.
NO_ATTACKER_NOTE = (
    "core decision: no attacker reading; on a few logits the early-stopped "
    "attacker is no reader (main job, stop 58: 0.74 ± 0.11 for gender on the "
    "two logits, 0.50 on their difference); its lin and mlp columns read it."
)


def _leakage(
    ctx,
    reps,
    probe_config,
    *,
    linear: bool,
    mlp: bool = False,
    pool=None,
    attacker: bool | str = True,
) -> dict[str, Any]:
    """Each attribute's probes of one row, one after the other; with
    ``pool`` (an executor) each attribute's entry is a future of it, which
    :func:`_resolve_leakage` reads (the same numbers). ``attacker=False``
    leaves the attacker's entries None (the ``core decision`` row); a string
    does the same with itself as the note."""

    def one(attr: str) -> dict[str, Any]:
        labels = {s: ctx.data.splits[s].attrs[attr] for s in SPLITS}
        n = len(ctx.data.attr_classes[attr])
        if attacker is not True:
            entry = {
                "mean": None,
                "std": None,
                "dev_mean": None,
                "dev_std": None,
                "per_seed_test": [],
                "best_epoch": [],
                "notes": [attacker if isinstance(attacker, str) else NO_ATTACKER_NOTE],
                "chance": 1.0 / n,
            }
            return others(entry, reps, labels, n)
        result = probes_lib.train_probe_ensemble(
            reps["train"],
            labels["train"],
            reps["dev"],
            labels["dev"],
            reps["test"],
            labels["test"],
            num_classes=n,
            config=probe_config,
        )
        summary = result.summary()
        entry = {
            "mean": summary["test_balanced_accuracy/mean"],
            "std": summary["test_balanced_accuracy/std"],
            "dev_mean": summary["dev_balanced_accuracy/mean"],
            "dev_std": summary["dev_balanced_accuracy/std"],
            "per_seed_test": [float(x) for x in result.test_balanced_accuracy],
            "best_epoch": [int(x) for x in result.best_epoch],
            "notes": list(result.notes),
            "chance": 1.0 / n,
        }
        return others(entry, reps, labels, n)

    def others(entry, reps, labels, n):
        """The linear probe and the converged MLP, where asked for."""
        if linear:
            lin = probes_lib.linear_probe(
                reps["train"],
                labels["train"],
                reps["dev"],
                labels["dev"],
                reps["test"],
                labels["test"],
                num_classes=n,
                tol=1e-4,
                class_weighted=True,
            )
            entry["linear"] = lin.summary() | {"converged": bool(lin.converged)}
        if mlp:
            entry["mlp"] = probes_lib.converged_mlp_probe(
                *(x for s in SPLITS for x in (reps[s], labels[s])), num_classes=n
            )
        return entry

    if pool is not None:
        return {attr: pool.submit(one, attr) for attr in ctx.attributes}
    return {attr: one(attr) for attr in ctx.attributes}


def _resolve_leakage(rows: Mapping[str, dict[str, Any]]) -> None:
    """Replaces every row's leakage futures by their entries (in place)."""
    for row in rows.values():
        row["leakage"] = {
            a: v.result() if isinstance(v, concurrent.futures.Future) else v
            for a, v in row["leakage"].items()
        }


def _row(
    ctx,
    rep,
    head,
    reps,
    probe_config,
    linear,
    splits,
    ood_sets=None,
    ood_reps=None,
    pool=None,
    mlp=False,
    attacker=True,
) -> dict[str, Any]:
    task = _task_metrics(ctx, rep, head, reps, splits)
    row = {f"{s}_task_acc": task[s]["accuracy"] for s in splits}
    row["degenerate"] = any(task[s].get("degenerate", False) for s in splits)
    for s in splits:
        if "bias_aligned/accuracy" in task[s]:
            row[f"{s}_bias_aligned_acc"] = task[s]["bias_aligned/accuracy"]
            row[f"{s}_bias_conflicting_acc"] = task[s]["bias_conflicting/accuracy"]
    row["task"] = task
    row["leakage"] = _leakage(
        ctx, reps, probe_config, linear=linear, mlp=mlp, pool=pool, attacker=attacker
    )
    if ood_sets:
        row["ood"] = {
            name: ood_lib.ood_metrics(oset, rep.predict(head, ood_reps[name]))
            for name, oset in ood_sets.items()
        }
    return row


class _Readout:
    """Stands in for the Representer in :func:`_row` where a row's task
    predictions come from its own readout of the row's representations."""

    def __init__(self, predict: Callable[[np.ndarray], np.ndarray]):
        self._predict = predict

    def predict(self, head: Any, h: np.ndarray) -> np.ndarray:
        del head
        return np.asarray(self._predict(np.asarray(h)))


def _readout_rows(
    ctx,
    built,
    probe_config,
    linear,
    splits,
    pool,
    mlp,
    key: str,
) -> dict[str, Any]:
    """Rows whose representations and task readout are built from the core's
    (``built``: ``{label: (reps, predict, info)}``; no OOD sets); ``info``
    goes to ``row[key]``. The decision and discriminant rows have no
    attacker reading (their few dimensions). A row whose ``info["weights"]
    ["same_as"]`` names an earlier row (the same diff) copies its readings."""
    rows = {}
    for label, (reps, predict, info) in built.items():
        kind = info.get("kind")
        same = info.get("weights", {}).get("same_as")
        if same in rows:
            # The leakage entries may still be futures (resolved per row).
            first = rows[same]
            rows[label] = {**first, "leakage": dict(first["leakage"]), key: info}
            continue
        row = _row(
            ctx,
            _Readout(predict),
            None,
            reps,
            probe_config,
            linear,
            splits,
            pool=pool,
            mlp=mlp,
            attacker=(
                discriminant_lib.NO_ATTACKER_NOTE
                if kind == "discriminant"
                else kind != "decision"
            ),
        )
        row[key] = info
        rows[label] = row
    return rows


def evaluate_run(
    workdir: str | Path,
    *,
    probe_config: probes_lib.ProbeConfig | None = None,
    weights: Mapping[str, float] | None = None,
    max_subset_size: int | None = None,
    inlp: bool = True,
    linear: bool = True,
    mlp: bool = True,
    batch_size: int = 128,
    allow_changed_inputs: bool = False,
    verify_inputs: bool = True,
    token_merge: Mapping[str, Any] | None = None,
    strength: Mapping[str, Any] | None = None,
    known_reps: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    task_only: Mapping[str, Any] | None = None,
    discriminant: Mapping[str, Any] | None = None,
    known_parts: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Evaluates the composition matrix of a finished run; see the module doc.

    Args:
      workdir: the run directory.
      probe_config: the attacker protocol (default: the paper's, 3 seeds).
      weights: optional weight per diff name (default 1 each).
      max_subset_size: largest number of diffs combined (default: all).
      inlp: add INLP rows (one per attribute) on the core representations.
      linear: add a linear probe to every leakage entry.
      mlp: add a converged MLP probe to every leakage entry
        (:data:`probes_lib.CONVERGED_MLP`: what the paper's early-stopped
        attacker misses of nonlinear and linearly erased information).
      batch_size: batch size for extracting representations.
      allow_changed_inputs: evaluate although the data, tokenizer or base
        differ from what the run was trained on (``workdir.check_inputs``).
      verify_inputs: compare the inputs with the run's ``inputs.json``
        (False where the caller has just done so: the end of training).
      token_merge: if given, build a token-merge diff per attribute on the
        core (:func:`moddiffy_jax.methods.token_merge.build_merges`, these
        keyword arguments: ``max_drop``, ``candidates``, ``share``,
        ``select_train``, ``cost_z``, ``floor_z``), write each to
        ``workdir/token_merge/<attribute>.safetensors`` and add the rows
        ``core+merge(<attribute>)`` and, for several, all merges together.
      strength: if given, choose the weight each attribute's diff is added
        with on train and dev (:func:`moddiffy_jax.methods.strength.calibrate`,
        these keyword arguments: ``max_drop``, ``select_train``, ``cost_z``,
        ``floor_z``, ``floor_stop``, ``up``, ``down``) and evaluate every
        composition with those weights (rows ``core+1.5*gender``); a diff
        given a weight in ``weights`` keeps it.
      known_reps: representations already encoded from the same exported
        params (row label -> split -> [N, H], e.g. the end-of-training
        table's); those rows and splits are not encoded again.
      task_only: if given (keyword arguments: ``max_drop``), add the rows
        ``core decision`` and ``core+bottleneck``
        (:mod:`moddiffy_jax.eval.bottleneck`) for runs with protected
        attributes.
      discriminant: if given (keyword arguments: ``max_drop``), add the rows
        ``core+discriminant(<attribute>)`` and, for several attributes, all
        together (:mod:`moddiffy_jax.eval.discriminant`: the core's
        representation projected onto its attribute-penalized task
        discriminant).
      known_parts: the core's last-layer parts by split, encoded with
        ``known_reps`` (``discriminant_diff.core_parts``); where the
        discriminants are written into diffs, the core is read with its
        parts so that those rows need no encoder pass.

    Returns:
      The results (also written to ``workdir/eval/results.json``).
    """
    from moddiffy_jax.context import build_context
    from moddiffy_jax.workdir import check_inputs

    start = time.time()
    workdir = Path(workdir)
    config = load_run_config(workdir)
    art = load_artifacts(workdir)
    ctx = build_context(config)
    if verify_inputs:
        check_inputs(workdir, ctx, allow_changed=allow_changed_inputs, record=False)
    # Probes, INLP and the floors read train as read, not its upsampled copies.
    ctx, known_reps = _train_as_read(ctx, known_reps)
    if ctx.attributes:
        missing = [s for s in SPLITS if s not in ctx.data.splits]
        if missing:
            raise ValueError(
                f"The run's data has no {missing} split; leakage probes need train, "
                "dev and test (set config.data.splits)."
            )
    # Without protected attributes (e.g. MNLI) there are no probes, and the
    # table reports whichever of dev/test the run has.
    eval_splits = tuple(s for s in ("dev", "test") if s in ctx.data.splits)
    if not eval_splits:
        raise ValueError(
            "The run's data has neither a dev nor a test split; add one to "
            "config.data.splits."
        )
    # Train representations only feed the probes and INLP.
    rep_splits = (("train",) if ctx.attributes else ()) + eval_splits
    probe_config = probe_config or probes_lib.ProbeConfig()
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(art.attribute_diffs))
    if unknown:
        raise ValueError(
            f"Weights given for {unknown}, which are not diffs of this run "
            f"(its diffs: {art.attribute_diffs})."
        )
    evaluator = Evaluator(ctx)
    rep = Representer(ctx, batch_size)
    # The run's attribute order (as in its own results), then any other diff.
    names = [a for a in ctx.attributes if a in art.diffs]
    names += [n for n in art.attribute_diffs if n not in names]
    ood_sets = load_run_ood_sets(config, ctx.data.task_classes)
    strengths = {}
    if strength is not None and ctx.attributes:
        strengths = _calibrate(ctx, evaluator, rep, art, names, weights, strength)
    rows: dict[str, Any] = {}
    merges = {}
    # The attackers train on worker threads while this thread encodes the
    # next rows (docs/speed.md, stop 36); each row's leakage is read at the end.
    pool = (
        concurrent.futures.ThreadPoolExecutor(probe_config.threads)
        if probe_config.threads > 1 and ctx.attributes
        else None
    )

    def row_of(reps, ood_reps=None):
        """One row of the table (OOD metrics where ``ood_reps`` are given)."""
        sets = ood_sets if ood_reps is not None else {}
        return _row(
            ctx,
            rep,
            art.head,
            reps,
            probe_config,
            linear,
            eval_splits,
            sets,
            ood_reps or {},
            pool,
            mlp,
        )

    # Where the time goes on this thread (results "timings"); the probes
    # train meanwhile on the pool, and "probes_wait_s" is what is left of
    # them at the end.
    timings: dict[str, float] = {}
    mark = time.time()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.time()
        timings[name] = timings.get(name, 0.0) + now - mark
        mark = now

    # A task diff (DiffPrun) is in the core row but not in art.core, which
    # the discriminant's diffs are written into: no closed form there.
    parts_wanted = "task" not in art.diffs and discriminant_diff.wants_parts(
        ctx.model, discriminant
    )
    try:
        core_reps = core_ood_reps = core_parts = None
        for label, subset, params in compositions(
            evaluator,
            art.core,
            {**art.diffs, **art.joint},
            names,
            weights=weights,
            max_subset_size=max_subset_size,
        ):
            known = (known_reps or {}).get(label, {})
            for s, h in known.items():
                if s in rep_splits and np.shape(h)[0] != len(ctx.data.splits[s]):
                    raise ValueError(
                        f"known_reps[{label!r}][{s!r}] has {np.shape(h)[0]} rows; the "
                        f"run's {s} split has {len(ctx.data.splits[s])}: pass the "
                        "representations of this run's own splits (or none)."
                    )
            if not subset and parts_wanted:
                reps, core_parts = discriminant_diff.encode_core(
                    rep,
                    params,
                    {s: ctx.data.splits[s] for s in rep_splits},
                    known,
                    known_parts or {},
                )
            else:
                reps = {
                    s: np.asarray(known[s]) if s in known else rep.represent(params, s)
                    for s in rep_splits
                }
            ood_reps = {
                n: rep.represent_split(params, o.split) for n, o in ood_sets.items()
            }
            if not subset:
                core_reps, core_ood_reps = reps, ood_reps
            logging.info("Evaluating %s", label)
            rows[label] = row_of(reps, ood_reps)
        lap("compositions_s")
        if inlp:
            for attr in ctx.attributes:
                y = {s: ctx.data.splits[s].attrs[attr] for s in SPLITS}
                fit = inlp_lib.fit_inlp(
                    core_reps["train"],
                    y["train"],
                    core_reps["dev"],
                    y["dev"],
                    num_classes=len(ctx.data.attr_classes[attr]),
                    tol=1e-4,
                )
                projected = {
                    s: np.asarray(
                        inlp_lib.apply_projection(core_reps[s], fit.projection)
                    )
                    for s in rep_splits
                }
                projected_ood = {
                    n: np.asarray(inlp_lib.apply_projection(h, fit.projection))
                    for n, h in core_ood_reps.items()
                }
                row = row_of(projected, projected_ood)
                row["inlp"] = {
                    "attribute": attr,
                    "directions_removed": int(fit.num_removed),
                }
                rows[f"core+INLP({attr})"] = row
            lap("inlp_s")
        # Rows read from the core's representations through their own task
        # readouts: the task-only references and the discriminants.
        readouts = []
        if task_only is not None:
            readouts.append(
                (
                    "task_only",
                    lambda: bottleneck_lib.task_only_reps(
                        ctx, rep, art.head, core_reps, **dict(task_only)
                    ),
                )
            )
        if discriminant is not None:
            readouts.append(
                (
                    "discriminant",
                    lambda: discriminant_lib.discriminant_reps(
                        ctx,
                        rep,
                        art.head,
                        core_reps,
                        save_dir=workdir / "eval" / "discriminant",
                        base_fingerprint=fingerprint(art.core),
                        core_params=art.core,
                        core_parts=core_parts,
                        **dict(discriminant),
                    ),
                )
            )
        for key, build in readouts if ctx.attributes else ():
            rows.update(
                _readout_rows(
                    ctx, build(), probe_config, linear, eval_splits, pool, mlp, key
                )
            )
            lap(f"{key}_s")
        if token_merge is not None and ctx.attributes:
            merges = _merge_rows(
                ctx,
                evaluator,
                rep,
                art,
                workdir,
                dict(token_merge),
                core_reps,
                rows,
                row_of,  # no OOD sets for the merge rows
            )
            lap("token_merge_s")
        _resolve_leakage(rows)
        lap("probes_wait_s")
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    results = {
        "workdir": str(workdir),
        "method": config.method.name,
        "dataset": ctx.data.name,
        "synthetic": bool(ctx.data.synthetic),
        "attributes": list(ctx.attributes),
        "diffs": {
            n: {"nnz": int(d.nnz()), "density": float(d.density())}
            for n, d in art.diffs.items()
        },
        **(
            {"joint": {n: {"nnz": int(d.nnz())} for n, d in art.joint.items()}}
            if art.joint
            else {}
        ),
        "weights": weights,
        "probe_config": dataclasses.asdict(probe_config),
        "bias": dict(getattr(ctx.data, "bias_summary", {}) or {}),
        "ood_sets": {
            n: {
                "source": o.source,
                "path": o.path,
                "label_map": o.label_map,
                "classes": list(o.classes),
                "num_examples": len(o),
            }
            for n, o in ood_sets.items()
        },
        "composition": rows,
        **({"token_merge": merges} if merges else {}),
        **({"strength": strengths} if strengths else {}),
        "floors": leakage_floors(ctx) if ctx.attributes else {},
        **(
            {"objective_choice": c}
            if (c := getattr(ctx, "objective_choice", None))
            else {}
        ),
        "wall_time_s": time.time() - start,
        "timings": timings,
    }
    out_dir = workdir / "eval"
    checkpoints.write_json_atomic(out_dir / "results.json", jsonable(results))
    (out_dir / "report.md").write_text(format_report(results))
    return results


def _calibrate(ctx, evaluator, rep, art, names, weights, options) -> dict[str, Any]:
    """Each attribute diff's weight (:mod:`moddiffy_jax.methods.strength`),
    set in ``weights`` unless the caller gave one; returns the choices'
    summaries."""
    from moddiffy_jax.methods import strength as strength_lib

    out = {}
    for name in names:
        if name not in ctx.attributes or name in weights:
            continue
        choice = strength_lib.calibrate(
            art.core,
            art.diffs[name],
            name,
            len(ctx.data.attr_classes[name]),
            ctx.data.splits["train"],
            ctx.data.splits["dev"],
            lambda core, diff, scale: evaluator.compose(core, [diff], [scale]),
            rep.represent_split,
            lambda h: rep.predict(art.head, h),
            **dict(options),
        )
        weights[name] = choice.scale
        out[name] = choice.summary()
        logging.info(
            "strength %s: weight %g (%s)",
            name,
            choice.scale,
            ", ".join(f"{r['scale']:g}: {r['cost']:.2f} pts" for r in choice.read),
        )
    return out


def _merge_rows(
    ctx, evaluator, rep, art, workdir, options, core_reps, rows, make_row
) -> dict[str, Any]:
    """Token-merge diffs on the core: chosen, written, and one row each (plus
    all together); returns ``{attribute: summary}``."""
    from moddiffy_jax.methods import token_merge as merge_lib
    from moddiffy_jax.models import text as text_lib
    from moddiffy_jax.subnets import diff_files

    choices = merge_lib.build_merges(
        art.core,
        ctx.data.splits["train"],
        ctx.data.splits["dev"],
        {a: len(ctx.data.attr_classes[a]) for a in ctx.attributes},
        rep.represent_split,
        lambda h: rep.predict(art.head, h),
        **options,
    )
    tokenizer = text_lib.load_tokenizer_for(ctx.config.model)
    out_dir = workdir / "token_merge"
    out_dir.mkdir(exist_ok=True)
    summaries, diffs = {}, {}
    for attr, choice in choices.items():
        summaries[attr] = choice.summary(tokenizer)
        if choice.diff is not None:
            path = out_dir / f"{attr}.safetensors"
            diff_files.save_sparse_diff(path, choice.diff, overwrite=True)
            summaries[attr]["path"] = str(path)
            diffs[attr] = choice.diff
        logging.info(
            "token merge %s: %d of %d candidates merged: %s",
            attr,
            choice.merged,
            len(choice.ranked),
            " ".join(map(str, summaries[attr]["tokens"])),
        )
    subsets = [(n,) for n in diffs] + ([tuple(diffs)] if len(diffs) > 1 else [])
    for subset in subsets:
        params = evaluator.compose(art.core, [diffs[n] for n in subset])
        ids = [t for n in subset for t in diffs[n].info["tokens"]]
        reps = {
            s: merge_lib.represent_merged(
                rep.represent_split, params, ctx.data.splits[s], h, ids
            )
            for s, h in core_reps.items()
        }
        label = "core" + "".join(f"+merge({n})" for n in subset)
        logging.info("Evaluating %s", label)
        rows[label] = make_row(reps)
    return summaries


def _train_as_read(ctx, known_reps):
    """``ctx`` with the train split as read (``data.balance``'s copies
    dropped: :func:`moddiffy_jax.data.original_train`) and ``known_reps``'
    train rows cut to match (the originals come first)."""
    from moddiffy_jax import data as data_lib

    originals = getattr(ctx.data, "train_originals", None)  # images: none
    if originals is None:
        return ctx, known_reps
    ctx = dataclasses.replace(ctx, data=data_lib.original_train(ctx.data))
    if known_reps:
        known_reps = {
            label: {
                s: np.asarray(h)[:originals] if s == "train" else h
                for s, h in splits.items()
            }
            for label, splits in known_reps.items()
        }
    return ctx, known_reps
