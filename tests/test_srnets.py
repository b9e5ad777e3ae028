"""SRNets through the shared loop: mask training, IMP, retraining, known-bias losses."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import checkpoints, train
from moddiffy_jax.methods import srnets
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import masks as masks_lib
from moddiffy_jax.subnets import selection
from tests.helpers import tiny

# Scores move fast enough on the tiny model to change the mask in a few steps.
MASK = {"srnets.reset_every": 2, "optim.lr_scores": 0.05, "train.num_steps": 6}
IMP = {"srnets.imp_rounds": 3, "srnets.sparsity": 0.6, "srnets.rewind": True}


@pytest.fixture(scope="module")
def mask_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mask")
    config = tiny("srnets_mask", "sparsity=0.7", **MASK)
    return workdir, train.train_and_evaluate(config, workdir)


@pytest.fixture(scope="module")
def imp_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("imp")
    return workdir, train.train_and_evaluate(tiny("srnets_imp", **IMP), workdir)


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("finetune")
    return workdir, train.train_and_evaluate(tiny("finetune"), workdir)


def _pretrained(config):
    return train.build_context(config).pretrained


def _num_pruned(n, s):
    return n - round((1 - s) * n)


def test_mask_training_exports_exact_per_matrix_sparsity(mask_run):
    workdir, results = mask_run
    sd = diffs_lib.load_sparse_diff(workdir / "export" / "diffs" / "mask.safetensors")
    assert sd.info["kind"] == "pruning"
    shapes = dict(sd.shapes)
    layers = json.loads((workdir / "config.json").read_text())["model"]["num_layers"]
    # Q, K, V, attention output, FFN in / out in every layer
    assert len(shapes) == layers * 6
    for path, shape in shapes.items():
        n = int(np.prod(shape))
        assert sd.nnz_per_leaf()[path] == _num_pruned(n, 0.7), path
        assert results["sparsity"]["per_matrix"][path] == pytest.approx(
            _num_pruned(n, 0.7) / n
        )
    assert "pooler/dense/kernel" not in shapes  # unused by the CLS classifier
    # Frozen weights: the exported core is the pretrained encoder, bit for bit.
    core, meta = checkpoints.load_params(workdir / "export" / "core.safetensors")
    pretrained = _pretrained(tiny("srnets_mask", **MASK))
    for a, b in zip(jax.tree.leaves(core), jax.tree.leaves(pretrained), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # core + mask is core * keep, exactly.
    pruned = diffs_lib.apply_diffs(core, [sd])
    flat, flat_core = selection.flatten(pruned), selection.flatten(core)
    for path in shapes:
        w, out = np.asarray(flat_core[path]).reshape(-1), np.asarray(flat[path])
        keep = np.ones(w.size, bool)
        keep[np.asarray(sd.indices[path])] = False
        np.testing.assert_array_equal(out.reshape(-1), np.where(keep, w, 0.0))
    assert set(results["composition"]) == {"core", "core+mask"}


def test_mask_training_moves_the_mask_but_not_the_weights(mask_run):
    workdir, _ = mask_run
    config = tiny("srnets_mask", "sparsity=0.7", **MASK)
    pretrained = _pretrained(config)
    include, exclude = srnets.rules(config)
    init = masks_lib.init_scores(
        pretrained, include, exclude=exclude, sparsity=0.7, init="magnitude"
    )
    init_keep = selection.flatten(masks_lib.binary_masks(init.scores, init.thresholds))
    sd = diffs_lib.load_sparse_diff(workdir / "export" / "diffs" / "mask.safetensors")
    changed = 0
    for path, keep0 in init_keep.items():
        keep = np.ones(keep0.size, bool)
        keep[np.asarray(sd.indices[path])] = False
        changed += int(np.sum(keep != np.asarray(keep0).reshape(-1)))
    assert changed > 0  # the scores were trained and the resets re-ranked them
    n = sum(int(np.size(m)) for m in init_keep.values())
    assert mask_run[1]["mask_changed_vs_init"] == pytest.approx(changed / n)


def test_mask_resume_equals_uninterrupted(mask_run, tmp_path):
    full_dir, _ = mask_run
    stop = {**MASK, "train.stop_at_step": 3}  # between two threshold resets
    with pytest.raises(train.Preempted):
        train.train_and_evaluate(tiny("srnets_mask", "sparsity=0.7", **stop), tmp_path)
    train.train_and_evaluate(tiny("srnets_mask", "sparsity=0.7", **MASK), tmp_path)
    a = diffs_lib.load_sparse_diff(full_dir / "export" / "diffs" / "mask.safetensors")
    b = diffs_lib.load_sparse_diff(tmp_path / "export" / "diffs" / "mask.safetensors")
    for p in a.indices:
        np.testing.assert_array_equal(a.indices[p], b.indices[p])


def test_cubic_schedule_reaches_final_sparsity(tmp_path):
    config = tiny(
        "srnets_mask",
        "sparsity=0.7",
        **MASK,
        **{
            "srnets.schedule": "cubic",
            "srnets.initial_sparsity": 0.2,
            "srnets.init": "magnitude_soft",
            "srnets.schedule_end": 0.5,
        },
    )
    assert srnets.target_sparsity(config, 0) == pytest.approx(0.2)
    assert 0.2 < srnets.target_sparsity(config, 2) < 0.7
    assert srnets.target_sparsity(config, 3) == pytest.approx(0.7)
    results = train.train_and_evaluate(config, tmp_path)
    assert results["sparsity"]["overall"] == pytest.approx(0.7, abs=1e-3)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").open()]
    targets = [
        r["mask/target_sparsity"] for r in records if "mask/target_sparsity" in r
    ]
    assert targets[0] < targets[-1] == pytest.approx(0.7)


def test_imp_round_fractions_and_rewinding():
    config = tiny("srnets_imp", **IMP)
    rng = np.random.default_rng(0)
    start = {"a": {"kernel": jnp.asarray(rng.normal(size=(10, 10)), jnp.float32)}}
    trained = {"a": {"kernel": start["a"]["kernel"] * 2.0 + 0.5}}
    keep = {"a": {"kernel": jnp.ones((10, 10), bool)}}
    head = {"kernel": jnp.ones((10, 2))}
    state = {"core": trained, "task_head": head, "masks": keep}
    previous = keep
    for k in range(3):
        state = srnets.imp_prune_round(config, state, {"start": start}, k)
        m = np.asarray(state["masks"]["a"]["kernel"])
        assert np.sum(~m) == round(100 * 0.6 * (k + 1) / 3)  # 20, 40, 60 pruned
        assert not np.any(m & ~np.asarray(previous["a"]["kernel"]))  # never regrows
        previous = state["masks"]
        w = np.asarray(state["core"]["a"]["kernel"])
        np.testing.assert_array_equal(w[~m], 0.0)
        np.testing.assert_array_equal(w[m], np.asarray(start["a"]["kernel"])[m])
        assert state["task_head"] is head  # the classifier is never rewound
    # Without rewinding the trained weights survive at kept entries.
    config = tiny("srnets_imp", **{**IMP, "srnets.rewind": False})
    state = {"core": trained, "task_head": head, "masks": keep}
    state = srnets.imp_prune_round(config, state, {"start": start}, 0)
    m = np.asarray(state["masks"]["a"]["kernel"])
    kept = np.asarray(trained["a"]["kernel"])[m]
    np.testing.assert_array_equal(np.asarray(state["core"]["a"]["kernel"])[m], kept)
    # The 20 pruned are the smallest |w| of the trained weights.
    mags = np.abs(np.asarray(trained["a"]["kernel"]))
    assert mags[~m].max() <= mags[m].min()


def test_imp_run_exports_mask_and_sparse_core(imp_run):
    workdir, results = imp_run
    sd = diffs_lib.load_sparse_diff(workdir / "export" / "mask.safetensors")
    core, _ = checkpoints.load_params(workdir / "export" / "core.safetensors")
    flat = selection.flatten(core)
    for path, shape in sd.shapes:
        n = int(np.prod(shape))
        assert sd.nnz_per_leaf()[path] == _num_pruned(n, 0.6)
        w = np.asarray(flat[path]).reshape(-1)
        np.testing.assert_array_equal(w[np.asarray(sd.indices[path])], 0.0)
    assert results["sparsity"]["overall"] == pytest.approx(0.6, abs=1e-3)
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").open()]
    assert {r["phase"] for r in records} == {"imp_0", "imp_1", "imp_2"}


def test_imp_resume_across_rounds_equals_uninterrupted(imp_run, tmp_path):
    full_dir, _ = imp_run
    with pytest.raises(train.Preempted):
        train.train_and_evaluate(
            tiny("srnets_imp", **IMP, **{"train.stop_at_step": 3}), tmp_path
        )
    train.train_and_evaluate(tiny("srnets_imp", **IMP), tmp_path)
    a, _ = checkpoints.load_params(full_dir / "export" / "core.safetensors")
    b, _ = checkpoints.load_params(tmp_path / "export" / "core.safetensors")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_retrain_keeps_the_found_mask(imp_run, tmp_path):
    mask_dir, _ = imp_run
    config = tiny("srnets_retrain", **{"srnets.mask_run": str(mask_dir)})
    results = train.train_and_evaluate(config, tmp_path)
    found = diffs_lib.load_sparse_diff(mask_dir / "export" / "mask.safetensors")
    again = diffs_lib.load_sparse_diff(tmp_path / "export" / "mask.safetensors")
    core, _ = checkpoints.load_params(tmp_path / "export" / "core.safetensors")
    pretrained = selection.flatten(_pretrained(config))
    flat = selection.flatten(core)
    for path in found.indices:
        np.testing.assert_array_equal(found.indices[path], again.indices[path])
        np.testing.assert_array_equal(
            np.asarray(flat[path]).reshape(-1)[np.asarray(found.indices[path])], 0.0
        )
        assert not np.array_equal(flat[path], pretrained[path])  # weights trained
    assert results["sparsity"]["overall"] == pytest.approx(0.6, abs=1e-3)


def test_paradigm1_mask_on_finetuned_model(finetune_run, tmp_path):
    ft_dir, _ = finetune_run
    config = tiny(
        "srnets_mask", **{**MASK, "method.core_run": str(ft_dir), "train.num_steps": 2}
    )
    train.train_and_evaluate(config, tmp_path)
    for name in ("core.safetensors", "task_head.safetensors"):
        a, _ = checkpoints.load_params(ft_dir / "export" / name)
        b, _ = checkpoints.load_params(tmp_path / "export" / name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)  # frozen, as exported
    sd = diffs_lib.load_sparse_diff(tmp_path / "export" / "diffs" / "mask.safetensors")
    core, meta = checkpoints.load_params(ft_dir / "export" / "core.safetensors")
    diffs_lib.check_base(sd, core)  # the mask is on the fine-tuned core


def test_bad_srnets_configs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="mask_run"):
        train.train_and_evaluate(tiny("srnets_retrain"), tmp_path / "a")
    with pytest.raises(ValueError, match="must lie in"):
        train.train_and_evaluate(
            tiny("srnets_mask", **{"srnets.sparsity": 1.5}), tmp_path / "b"
        )
    with pytest.raises(ValueError, match="schedule"):
        train.train_and_evaluate(
            tiny("srnets_mask", **{"srnets.schedule": "linear"}), tmp_path / "c"
        )
    with pytest.raises(ValueError, match="task_loss"):
        train.train_and_evaluate(
            tiny("finetune", **{"method.task_loss": "focal"}), tmp_path / "d"
        )


def test_known_bias_losses_read_the_batch_bias_model():
    from moddiffy_jax.methods import common
    from moddiffy_jax.objectives import known_bias

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    bias = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(4, 3)), jnp.float32))
    teacher = jax.nn.softmax(jnp.asarray(rng.normal(size=(4, 3)), jnp.float32))
    batch = {
        "task": jnp.asarray([0, 1, 2, 1]),
        "extras": {"bias_logprobs": bias, "teacher_probs": teacher},
    }
    y, pb = batch["task"], jnp.exp(bias)
    expected = {
        "poe": known_bias.product_of_experts_loss(logits, y, pb),
        "reweighting": known_bias.example_reweighting_loss(logits, y, pb),
        "conf_reg": known_bias.confidence_regularization_loss(logits, y, pb, teacher),
    }
    for name, value in expected.items():
        np.testing.assert_allclose(common.task_loss_value(name, logits, batch), value)
    with pytest.raises(ValueError, match="data.bias.source"):
        common.task_loss_value("poe", logits, {"task": y, "extras": {}})


@pytest.mark.parametrize("loss", ["poe", "reweighting"])
def test_mask_training_with_known_bias_loss(loss, tmp_path):
    config = tiny("srnets_mask", f"loss={loss}", **MASK)
    assert config.data.bias.source == "attribute"
    results = train.train_and_evaluate(config, tmp_path)
    assert results["bias_model"]["splits"]["train"]["accuracy"] > 0.5
    for row in results["composition"].values():
        assert 0.0 <= row["dev_bias_conflicting_acc"] <= 1.0
        assert 0.0 <= row["dev_bias_aligned_acc"] <= 1.0


def test_conf_reg_distils_a_teacher_run(finetune_run, tmp_path):
    ft_dir, _ = finetune_run
    config = tiny("finetune", "loss=conf_reg", **{"method.teacher_run": str(ft_dir)})
    ctx = train.build_context(config)
    probs = ctx.data.splits["train"].extras["teacher_probs"]
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    results = train.train_and_evaluate(config, tmp_path)
    assert "core" in results["composition"]
    with pytest.raises(ValueError, match="teacher_run"):
        train.build_context(tiny("finetune", "loss=conf_reg"))


def test_mask_run_evaluated_with_the_evaluate_command(mask_run):
    from moddiffy_jax.eval import composition, probes

    workdir, _ = mask_run
    fast = probes.ProbeConfig(seeds=(0,), members=1, max_epochs=2)
    results = composition.evaluate_run(
        workdir, probe_config=fast, inlp=False, linear=False
    )
    assert list(results["composition"]) == ["core", "core+mask"]
    for row in results["composition"].values():
        assert set(row["leakage"]) == {"gender", "age"}
    assert "core+mask" in composition.format_report(results)


def test_mnli_mask_training_with_word_overlap_poe_and_hans(tmp_path):
    """MNLI/HANS from the user's files (tiny ones in the real formats)."""
    from tests.test_bias_ood import _hans_file, _mnli_file

    pairs = [
        ("the cat sat on the mat .", "the cat sat .", "entailment"),
        ("a man plays a guitar .", "a woman sings .", "neutral"),
        ("the dog runs fast .", "the dog sleeps .", "contradiction"),
        ("kids play in the park .", "kids play .", "entailment"),
    ] * 6
    data_dir = tmp_path / "MNLI"
    data_dir.mkdir()
    _mnli_file(data_dir / "train.tsv", pairs)
    _mnli_file(data_dir / "dev_matched.tsv", pairs[:8])
    hans = _hans_file(tmp_path / "heuristics_evaluation_set.txt")
    config = tiny(
        "srnets_mask",
        "data=mnli,loss=poe",
        **{**MASK, "data.path": str(data_dir), "eval.ood.hans.path": hans},
    )
    results = train.train_and_evaluate(config, tmp_path / "run")
    assert results["bias_model"]["features"] == [
        "h-is-subseq",
        "all-in-p",
        "percent-in-p",
        "log-len-diff",
    ]
    for label in ("core", "core+mask"):
        hans_metrics = results["ood"][label]["hans"]
        assert hans_metrics["num_examples"] == 6
        assert 0.0 <= hans_metrics["accuracy"] <= 1.0
    assert set(results["composition"]["core"]) >= {"dev_task_acc"}
