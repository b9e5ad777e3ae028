"""Regression test: a trained diff removes its attribute, as fresh probes see it.

A tiny BERT core is fine-tuned on SYNTHETIC data, then the gender marker
words are planted into it: their word embeddings are moved along one random
direction, +1 for female markers and -1 for male ones, so the core's CLS
vectors carry gender well beyond what the task label implies (the floor).
MoDDiffy-post then trains one sparse gender diff on that frozen core with the
library's default recipe (unbiased task-conditional MMD with linear and
Gaussian kernels in the metric of the attribute groups' running covariance,
the running linear-erasure term, gradual pruning to the budget, fixmask).
A fresh class-balanced linear probe, fit on frozen train representations,
must leak clearly less on held-out data with the diff than without it, and
clearly less than with a control diff trained the same way without any
removal term, with the task kept. A change that breaks removal (the
objective, the gradual pruning, the cut, the fixmask phase) fails here.

Why the control (stop 14): on this core, training a diff on the task alone
takes the probe from 0.80 to 0.58 (the planted direction is fragile), so
"less than the core" alone passed with every removal term switched off.

Expected to fail for now (strict xfail): every removal objective we have
leaves more of the planted signal than the control does (docs/efficacy.md,
"Stop 14"). The assertions stay as they are; the day a change makes them
hold, the strict marker fails CI and must be removed.

The counterfactual swaps (config.method.swap_weight, stop 39) do remove
the planted signal: ``test_a_swap_diff_removes_the_planted_attribute``
(not expected to fail; with data seeds 0 and 2 of this setup the swap
diff closed 1.01 and 0.78 of the gap, the control 0.82 and 0.47; seed 1
passes too).

The adversarial objective is not asserted: under fresh probes it removes
nothing on MiniLM either (docs/efficacy.md), so a test that it does would be
false.
"""

import numpy as np
import pytest

from moddiffy_jax import checkpoints, manifest, train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.data import synthetic
from moddiffy_jax.eval import composition, removal
from moddiffy_jax.models import bert
from moddiffy_jax.subnets import sparse_diff


def _data(c):
    c.data.attributes = ("gender",)
    # Independent of the task (floor = chance): only the planted signal leaks.
    c.data.synthetic.attr_task_correlation.gender = 0.0
    c.data.synthetic.num_train = 512
    c.data.synthetic.num_dev = 128
    c.data.synthetic.num_test = 256
    c.train.batch_size = 32
    c.train.checkpoint_every = 1000
    c.train.log_every = 50


#: Shift of the marker embeddings, in units of the mean embedding norm.
SCALE = 10.0


def _plant_gender(core_dir):
    """Moves the gender marker words' embeddings apart along one direction."""
    path = core_dir / "export" / "core.safetensors"
    core, meta = checkpoints.load_params(path)
    tok = bert.load_tokenizer()
    emb = np.array(core["embeddings"]["word_embeddings"]["embedding"])
    u = np.random.default_rng(0).normal(size=emb.shape[1])
    u *= SCALE * np.linalg.norm(emb, axis=1).mean() / np.linalg.norm(u)
    for sign, cls in ((1.0, "female"), (-1.0, "male")):
        for phrase in synthetic.ATTR_MARKERS["gender"][cls]:
            for token_id in tok(phrase, add_special_tokens=False)["input_ids"]:
                if tok.convert_ids_to_tokens(token_id) not in ("my", "her", "his"):
                    emb[token_id] += sign * u
    core["embeddings"]["word_embeddings"]["embedding"] = emb
    checkpoints.save_params(path, core, metadata=meta, overwrite=True)
    # The planted core is a new export: its manifest must say so, or loading
    # it fails the integrity check (as it should for a changed file).
    manifest.write_manifest(path.parent, fingerprint=sparse_diff.fingerprint(core))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny finetune core, gender planted (shared by this module's tests);
    its run directory."""
    return planted_core(tmp_path_factory.mktemp("planted"))


def planted_core(tmp_path):
    """Trains the tiny finetune core in ``tmp_path / "core"`` and plants
    gender into it; its run directory."""
    core_cfg = experiment_config("finetune", "model=tiny")
    core_cfg.unlock()
    _data(core_cfg)
    core_cfg.train.num_steps = 48
    core_cfg.optim.lr_encoder = 1e-3
    core_cfg.lock()
    train.train_and_evaluate(core_cfg, tmp_path / "core")
    _plant_gender(tmp_path / "core")
    return tmp_path / "core"


def post_config(core, l0_steps, fixmask_steps, **fields):
    """A tiny MoDDiffy-post config on the planted ``core`` (``fields``:
    ``section__field`` overrides)."""
    config = experiment_config("moddiffy_post", "model=tiny")
    config.unlock()
    _data(config)
    config.method.core_run = str(core)
    config.train.l0_steps = l0_steps
    config.train.fixmask_steps = fixmask_steps
    for key, value in fields.items():
        section, field = key.split("__")
        config[section][field] = value
    config.lock()
    return config


def _train_diff(core, tmp_path, name, **method_overrides):
    """MoDDiffy-post on the planted ``core`` into ``tmp_path / name``; its config."""
    fields = {f"method__{k}": v for k, v in method_overrides.items()}
    config = post_config(core, 80, 20, optim__lr_diff=1e-3, **fields)
    train.train_and_evaluate(config, tmp_path / name)
    return config


def _train_control(core, tmp_path):
    """The same diff training without any removal term, in ``tmp_path /
    "control"``."""
    _train_diff(
        core, tmp_path, "control", mmd_weight=0.0, fisher_weight=0.0, target_weight=0.0
    )


def _leakage(config, run_dirs):
    """Test leakage of a fresh linear probe and task accuracy of the core
    and of core+gender for each run in ``run_dirs``, and the floor."""
    ctx = train.build_context(config)
    evaluator = train.Evaluator(ctx)
    rep = composition.Representer(ctx, 128)
    splits = ctx.data.splits
    labels = {s: splits[s].attrs["gender"] for s in ("train", "test")}
    leak, acc = {}, {}
    rows = []
    for name, run_dir in run_dirs.items():
        art = composition.load_artifacts(run_dir)
        if not rows:
            rows.append(("core", art.core, art.head))
        diff = evaluator.compose(art.core, [art.diffs["gender"]])
        rows.append((name, diff, art.head))
    for label, params, head in rows:
        reps = {s: rep.represent(params, s) for s in ("train", "test")}
        leak[label] = removal.fresh_linear_leakage(
            reps, labels, num_classes=2, split="test"
        )
        acc[label] = np.mean(rep.predict(head, reps["test"]) == splits["test"].task)
    floor = removal.leakage_floor(
        splits["train"].task,
        labels["train"],
        splits["test"].task,
        labels["test"],
        num_task_classes=2,
        num_attr_classes=2,
    )
    return leak, acc, floor


@pytest.mark.xfail(
    strict=True,
    # Only the removal assertions may fail: an error anywhere else (stop 20
    # found the planted core rejected by the export's integrity check, which
    # a bare xfail had counted as the expected failure) fails CI.
    raises=AssertionError,
    reason=(
        "issue 11, open: on this planted core a diff trained on the task "
        "alone (no removal term) takes the probe from 0.80 to 0.58, and "
        "every removal objective we have leaves more than that (stop 14: "
        "the default 0.74, MMD alone 0.73, adversarial 0.95, erased "
        "targets 0.84-0.91). Strict: a change that makes it pass fails CI "
        "until this marker is removed."
    ),
)
def test_diff_removes_planted_attribute(planted, tmp_path):
    config = _train_diff(planted, tmp_path, "removal")
    leak, acc, floor = _leakage(config, {"removal": tmp_path / "removal"})
    report = {"leak": leak, "acc": acc, "floor": floor}
    assert leak["core"] - floor > 0.12, report  # planted: something to remove
    assert composition.gap_closed(leak["core"], leak["removal"], floor) > 0.5, report
    assert acc["removal"] > acc["core"] - 0.1, report
    # The control, trained only once the removal is there (the test is
    # expected to fail above until issue 11's trained diffs remove): the
    # same diff training without any removal term. Any training of a diff
    # moves the representation (on this core it moves the planted direction
    # a lot); removal is what the terms add to that.
    _train_control(planted, tmp_path)
    control, _, _ = _leakage(config, {"control": tmp_path / "control"})
    report["leak"]["control"] = control["control"]
    # Well beyond what training a diff at all does (a margin above the
    # seed-to-seed spread of this setup).
    assert leak["removal"] < control["control"] - 0.1, report


def test_a_swap_diff_removes_the_planted_attribute(planted, tmp_path):
    """The counterfactual swaps (config.method.swap_weight; objectives/
    counterfactual.py) on the same planted core: the diff, trained with the
    swap term alone, takes a fresh linear probe most of the way from the
    core to the floor and well below the control (the same training without
    any removal term), with the task kept."""
    config = _train_diff(
        planted, tmp_path, "swap", swap_weight=10.0, mmd_weight=0.0, fisher_weight=0.0
    )
    _train_control(planted, tmp_path)
    leak, acc, floor = _leakage(
        config, {"swap": tmp_path / "swap", "control": tmp_path / "control"}
    )
    report = {"leak": leak, "acc": acc, "floor": floor}
    assert leak["core"] - floor > 0.12, report  # planted: something to remove
    assert composition.gap_closed(leak["core"], leak["swap"], floor) > 0.7, report
    # Training a diff at all moves this fragile plant most of the way (the
    # control: 0.54 from 0.77, floor 0.49); the swaps take at least half of
    # what the control leaves.
    assert leak["swap"] - floor < 0.5 * (leak["control"] - floor), report
    assert acc["swap"] > acc["core"] - 0.1, report
