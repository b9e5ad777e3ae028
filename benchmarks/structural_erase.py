r"""INLP's removed span made a weight edit, probed afresh (stop 38; negative).

INLP (``moddiffy_jax.eval.inlp``) projects the frozen CLS vectors of a run's
core off a span U. This script asks whether the same span can be removed
by editing the encoder's weights instead, so that the edit is a diff. In a
post-LayerNorm BERT the CLS vector is ``h = g * norm(x) + b``, and
``h . u`` is constant for every input exactly when ``x`` is orthogonal to
the centred ``g * u``. ``x`` is a sum of writes into the residual stream
(each sub-layer's output dense, its bias, the previous LayerNorm's
output), so the span is carried down the stream through each LayerNorm's
scale and centring, and every write is projected off the span at its
level, down to the embedding tables. The edited core's CLS vectors are
then constant along U (the script prints the largest spread, about 1e-6),
but the rest of the network sees a changed stream, so what the probes read
elsewhere is measured, not assumed.

    python benchmarks/structural_erase.py --run RUN --attribute dialect

Prints, for the core, the INLP projection and the edited core: the test
accuracy of the run's own task head, and the test balanced accuracy of a
fresh scikit-learn logistic regression and MLP (``linear_eraser.probes``)
beside the attribute's floor. Needs scikit-learn (not a dependency of the
library). docs/efficacy.md ("Stop 38") has what it measured.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from linear_eraser import probes  # benchmarks/ is on sys.path as a script

SPLITS = ("train", "dev", "test")


def _orth(m: np.ndarray) -> np.ndarray:
    u, s, _ = np.linalg.svd(m, full_matrices=False)
    return u[:, s > 1e-8 * s.max()]


def carry(basis: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The span a LayerNorm's input must avoid for its output (scale
    ``scale``) to be constant along ``basis``: scaled, centred."""
    m = np.asarray(scale, np.float64)[:, None] * basis
    return _orth(m - m.mean(0, keepdims=True))


def project(x: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """``x`` (last axis H) off the span of the orthonormal ``basis``."""
    x = np.asarray(x, np.float64)
    return (x - (x @ basis) @ basis.T).astype(np.float32)


def structural_edit(flat: dict, top: np.ndarray) -> dict:
    """The flat BERT params edited so that the last layer's outputs are
    constant along ``top`` (orthonormal [H, r]) for every input."""
    new = dict(flat)
    layers = sorted(
        {int(k.split("/")[1][len("layer_") :]) for k in flat if "/layer_" in k}
    )
    basis = carry(top, flat[f"encoder/layer_{layers[-1]}/output/LayerNorm/scale"])
    for i in reversed(layers):
        p = f"encoder/layer_{i}"
        for k in ("output/dense/kernel", "output/dense/bias"):
            new[f"{p}/{k}"] = project(new[f"{p}/{k}"], basis)
        new[f"{p}/attention/output/LayerNorm/bias"] = project(
            new[f"{p}/attention/output/LayerNorm/bias"], basis
        )
        basis = carry(basis, flat[f"{p}/attention/output/LayerNorm/scale"])
        for k in ("attention/output/dense/kernel", "attention/output/dense/bias"):
            new[f"{p}/{k}"] = project(new[f"{p}/{k}"], basis)
        below = (
            f"encoder/layer_{i - 1}/output/LayerNorm"
            if i > layers[0]
            else "embeddings/LayerNorm"
        )
        new[f"{below}/bias"] = project(new[f"{below}/bias"], basis)
        basis = carry(basis, flat[f"{below}/scale"])
    for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        key = f"embeddings/{table}/embedding"
        new[key] = project(new[key], basis)
    return new


def main() -> None:
    from moddiffy_jax.context import build_context
    from moddiffy_jax.eval import composition
    from moddiffy_jax.eval import inlp as inlp_lib
    from moddiffy_jax.subnets import selection

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished text run")
    parser.add_argument("--attribute", required=True)
    parser.add_argument("--directions", type=int, default=10, help="INLP rounds")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()

    start = time.time()
    ctx = build_context(composition.load_run_config(args.run))
    art = composition.load_artifacts(args.run)
    rep = composition.Representer(ctx, 128)
    splits = ctx.data.splits
    if args.attribute not in ctx.attributes:
        raise SystemExit(
            f"error: the run has no attribute {args.attribute!r}; "
            f"it has {list(ctx.attributes)}."
        )
    y = {s: np.asarray(splits[s].attrs[args.attribute]) for s in SPLITS}
    task = {s: np.asarray(splits[s].task) for s in SPLITS}
    classes = len(ctx.data.attr_classes[args.attribute])
    core_h = {s: rep.represent(art.core, s) for s in SPLITS}
    fit = inlp_lib.fit_inlp(
        core_h["train"],
        y["train"],
        core_h["dev"],
        y["dev"],
        num_classes=classes,
        tol=1e-4,
        n_iterations=args.directions,
    )
    top = np.asarray(fit.directions, np.float64)
    flat = {k: np.asarray(v) for k, v in selection.flatten(art.core).items()}
    new = structural_edit(flat, top)
    changed = sum(int(np.sum(new[k] != flat[k])) for k in flat)
    total = sum(v.size for v in flat.values())
    edited_h = {s: rep.represent(selection.unflatten(new), s) for s in SPLITS}
    spread = float(np.ptp(edited_h["test"] @ top, axis=0).max())
    floor = composition.leakage_floors(ctx)[args.attribute]["floor"]
    out = {
        "directions": int(top.shape[1]),
        "entries_changed": changed,
        "entries": total,
        "spread_along_span": spread,
        "floor": floor,
    }
    print(
        f"{top.shape[1]} INLP directions; the edit changes {changed:,} of "
        f"{total:,} entries; test CLS spread along the span {spread:.2g}"
    )
    projected = {s: core_h[s] @ fit.projection for s in SPLITS}
    for name, h in (("core", core_h), ("INLP", projected), ("edited", edited_h)):
        acc = float(np.mean(rep.predict(art.head, h["test"]) == task["test"]))
        lin, mlp = probes(h["train"], y["train"], h["test"], y["test"])
        out[name] = {"test_acc": acc, "linear": float(lin), "mlp": float(mlp)}
        print(
            f"{name}: test acc {acc:.4f}, {args.attribute} linear {lin:.3f}, "
            f"MLP {mlp:.3f} (floor {floor:.3f})"
        )
    print(f"{time.time() - start:.0f} s")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
