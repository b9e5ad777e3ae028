r"""Each composition's task head refit on dev (last-layer retraining): does the
shared head carry the diffs' task cost?

A diff changes the representation the core's head was trained on. Where
the head, not the representation, is what loses the task (the removed
marker's weight still in the head, the task word's too small), a head fit
again for each composition would win the cost back at no loss of removal
(the probes read the representation, not the head). This refits the
linear head of every configuration of finished runs on its dev
representations (multinomial logistic regression pulled toward the
shared head by ``lam * ||W - W_core||^2 / 2``, ``lam`` chosen by 5-fold
cross-validation on dev, full-batch L-BFGS) and scores it on test, next
to the run's own head. The cost of a refit composition is read against
the core's own head and against the core's refit head: the refit also
moves the core, and only the second comparison says what it does for a
diff.

    python benchmarks/head_refit.py --run RUN [--run RUN ...]

Exports ``eval/reps/`` first where missing (``benchmarks/fresh_probe.py``).
Linear heads only (``model.task_hidden=0``, the default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAMS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)


def _fit(h, y, w0, b0, lam, steps=100):
    import jax
    import jax.numpy as jnp
    import optax

    def loss(p):
        w, b = p
        logp = jax.nn.log_softmax(h @ w + b)
        ce = -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))
        return ce + 0.5 * lam * jnp.sum((w - w0) ** 2)

    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss)

    def body(_, carry):
        p, state = carry
        value, grad = value_and_grad(p, state=state)
        updates, state = opt.update(
            grad, state, p, value=value, grad=grad, value_fn=loss
        )
        return optax.apply_updates(p, updates), state

    p = (w0, b0)
    return jax.lax.fori_loop(0, steps, body, (p, opt.init(p)))[0]


def _accuracy(p, h, y) -> float:
    return float(np.mean(np.argmax(np.asarray(h @ p[0] + p[1]), -1) == y))


def refit(h_dev, y_dev, w0, b0, folds=5, seed=0):
    """The head refit on dev: ``(params, lam)`` with ``lam`` chosen by CV."""
    import jax
    import jax.numpy as jnp

    fit = jax.jit(_fit)
    h, y = jnp.asarray(h_dev), jnp.asarray(y_dev)
    order = np.random.default_rng(seed).permutation(len(y_dev))
    parts = np.array_split(order, folds)
    scores = []
    for lam in LAMS:
        hits = 0.0
        for part in parts:
            rest = np.setdiff1d(order, part)
            p = fit(h[rest], y[rest], w0, b0, jnp.float32(lam))
            hits += _accuracy(p, h[part], y_dev[part]) * len(part)
        scores.append(hits / len(y_dev))
    lam = LAMS[int(np.argmax(scores))]
    return fit(h, y, w0, b0, jnp.float32(lam)), lam


def run_rows(run: Path) -> dict:
    import fresh_probe
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    reps = fresh_probe.reps_dir(run, 0)
    if not (reps / "core.npz").exists():
        fresh_probe.export_run(run, 0)
    head = load_file(str(run / "export" / "task_head.safetensors"))
    if set(head) != {"output/kernel", "output/bias"}:
        raise SystemExit(f"{run}: the head is not linear ({sorted(head)}).")
    w0, b0 = jnp.asarray(head["output/kernel"]), jnp.asarray(head["output/bias"])
    out = {}
    files = sorted(reps.glob("core*.npz"), key=lambda p: (len(p.stem), p.stem))
    for path in files:
        z = np.load(path)
        h_test, y_test = jnp.asarray(z["test_h"]), z["test_task"]
        p, lam = refit(z["dev_h"], z["dev_task"], w0, b0)
        out[path.stem] = {
            "own": _accuracy((w0, b0), h_test, y_test),
            "refit": _accuracy(p, h_test, y_test),
            "lam": lam,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, type=Path)
    args = parser.parse_args()
    for run in args.run:
        rows = run_rows(run)
        core = rows["core"]
        print(
            f"{run}: core test acc {core['own']:.4f} (own head), "
            f"{core['refit']:.4f} (refit, lam {core['lam']:g})"
        )
        print("  configuration: own head; refit vs core's own; refit vs core refit")
        for label, r in rows.items():
            if label == "core":
                continue
            own = 100 * (r["own"] - core["own"])
            vs_own = 100 * (r["refit"] - core["own"])
            vs_refit = 100 * (r["refit"] - core["refit"])
            print(
                f"  {label}: {own:+.2f}; {vs_own:+.2f}; {vs_refit:+.2f} "
                f"(lam {r['lam']:g})"
            )


if __name__ == "__main__":
    main()
