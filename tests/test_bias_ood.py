"""Bias-only model extras, OOD sets (HANS, PAWS) and their evaluation columns."""

import csv
import json
import time
import types

import ml_collections
import numpy as np
import pytest

from moddiffy_jax import data
from moddiffy_jax.data import bias, nli
from moddiffy_jax.data.dataset import dataset_with_extras, with_extras
from moddiffy_jax.eval import composition, ood
from tests.test_data_nli import HANS_HEADER, MNLI_HEADER, _write_tsv


def _mnli_file(path, pairs):
    """pairs: (premise, hypothesis, label) -> an MNLI TSV."""
    rows = [
        [str(i), "p", "q", "fiction", "", "", "", "", prem, hyp, lab, lab]
        for i, (prem, hyp, lab) in enumerate(pairs)
    ]
    return _write_tsv(path, MNLI_HEADER, rows)


def _index_split(n, extras=None):
    ids = np.tile(np.arange(n, dtype=np.int32)[:, None], (1, 4))
    split = data.TokenizedSplit(
        input_ids=ids,
        attention_mask=np.ones_like(ids),
        token_type_ids=np.zeros_like(ids),
        task=(np.arange(n) % 3).astype(np.int32),
        attrs={},
    )
    return with_extras(split, **(extras or {}))


# ---------------------------------------------------------------- extras


def test_extras_flow_through_pipeline():
    n = 10
    rows = np.arange(n, dtype=np.float64)
    logp = np.stack([rows, -rows, rows * 2], axis=1)  # row i identifies itself
    split = _index_split(n, {"bias_logprobs": logp})
    assert split.extras["bias_logprobs"].dtype == np.float32
    assert _index_split(n).take(np.array([0, 1]))["extras"] == {}
    it = data.TrainIterator(split, batch_size=4, seed=0, num_threads=0)
    for _ in range(4):
        b = next(it)
        ids = b["input_ids"][:, 0]
        np.testing.assert_array_equal(b["extras"]["bias_logprobs"][:, 0], ids)
        assert b["extras"]["bias_logprobs"].shape == (4, 3)
    it.close()
    seen = []
    for b in data.eval_batches(split, 4):
        np.testing.assert_array_equal(
            b["extras"]["bias_logprobs"][:, 0], b["input_ids"][:, 0]
        )
        seen.append(b["extras"]["bias_logprobs"][b["weight"] > 0, 0])
    np.testing.assert_array_equal(np.concatenate(seen), rows)
    # with_extras merges and leaves the input untouched.
    both = with_extras(split, teacher_probs=np.ones((n, 3)))
    assert set(both.extras) == {"bias_logprobs", "teacher_probs"}
    assert set(split.extras) == {"bias_logprobs"}


def test_misaligned_extras_rejected():
    with pytest.raises(ValueError, match=r"leading dimension 10.*\[9, 3\]"):
        _index_split(10, {"bias_logprobs": np.zeros((9, 3))})
    with pytest.raises(ValueError, match="must be float32"):
        ids = np.zeros((2, 4), np.int32)
        data.TokenizedSplit(
            input_ids=ids,
            attention_mask=ids,
            token_type_ids=ids,
            task=np.zeros(2, np.int32),
            attrs={},
            extras={"x": np.zeros((2, 3))},
        )
    with pytest.raises(ValueError, match="numeric"):
        _index_split(2, {"x": np.array(["a", "b"])})
    ds = data.TokenizedDataset(
        splits={"train": _index_split(3)},
        task_classes=("a", "b", "c"),
        attr_classes={},
        name="t",
        synthetic=True,
        max_length=4,
    )
    with pytest.raises(ValueError, match=r"splits \['dev'\]"):
        dataset_with_extras(ds, {"dev": {"x": np.zeros((3, 1))}})
    out = dataset_with_extras(ds, {"train": {"x": np.zeros((3, 1))}})
    assert (
        out.splits["train"].extras["x"].shape == (3, 1)
        and not ds.splits["train"].extras
    )


# ---------------------------------------------------------------- bias model


def _attr_dataset():
    # dialect a=0: 8 x label 0, 2 x label 1; a=1: 3 x label 0, 7 x label 1.
    task = np.array([0] * 8 + [1] * 2 + [0] * 3 + [1] * 7, np.int32)
    attr = np.array([0] * 10 + [1] * 10, np.int32)
    split = data.RawSplit(
        text=[f"t{i}" for i in range(20)],
        text_pair=None,
        task=task,
        attrs={"dialect": attr},
    )
    return data.TextDataset(
        splits={"train": split, "dev": split.take(np.array([0, 19]))},
        task_classes=("neg", "pos"),
        attr_classes={"dialect": ("aae", "sae")},
        name="toy",
        synthetic=True,
    )


def _bias_config(**kw):
    c = bias.default_bias_config()
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_attribute_bias_model_conditional_and_balanced():
    ds = _attr_dataset()
    # Nearly unregularised, unweighted: the saturated model's MLE is the
    # empirical conditional p(y | a).
    cfg = _bias_config(
        source="attribute", attributes=("dialect",), l2=1e-6, class_weight="none"
    )
    extras, summary = bias.compute_bias_extras(ds, cfg)
    p = np.exp(extras["train"]["bias_logprobs"])
    np.testing.assert_allclose(p[0], [0.8, 0.2], atol=1e-3)
    np.testing.assert_allclose(p[10], [0.3, 0.7], atol=1e-3)
    np.testing.assert_allclose(p.sum(1), 1, atol=1e-6)
    assert summary["converged"] and summary["features"] == [
        "dialect=aae",
        "dialect=sae",
    ]
    assert summary["splits"]["train"]["accuracy"] == pytest.approx(15 / 20)
    # Balanced: n_neg = 11, n_pos = 9, w_k = 20 / (2 n_k); p(y|a) ∝ n(a, y) w_y.
    cfg.class_weight = "balanced"
    extras, summary = bias.compute_bias_extras(ds, cfg)
    assert summary["class_weights"] == pytest.approx({"neg": 20 / 22, "pos": 20 / 18})
    p = np.exp(extras["train"]["bias_logprobs"])
    a0 = np.array([8 / 11, 2 / 9])
    np.testing.assert_allclose(p[0], a0 / a0.sum(), atol=1e-3)
    # Stronger L2 keeps the ordering; dev rows get the same model.
    cfg.l2 = 1.0
    extras, _ = bias.compute_bias_extras(ds, cfg)
    lp = extras["train"]["bias_logprobs"]
    assert lp[0, 0] > lp[0, 1] and lp[10, 1] > lp[10, 0]
    np.testing.assert_array_equal(extras["dev"]["bias_logprobs"], lp[[0, 19]])
    again, _ = bias.compute_bias_extras(ds, cfg)  # deterministic, bit for bit
    np.testing.assert_array_equal(again["train"]["bias_logprobs"], lp)
    with pytest.raises(ValueError, match=r"\['gender'\].*\['dialect'\]"):
        bias.compute_bias_extras(
            ds, _bias_config(source="attribute", attributes=("gender",))
        )
    with pytest.raises(ValueError, match="valid"):
        bias.compute_bias_extras(ds, _bias_config(source="model"))
    with pytest.raises(ValueError, match="needs sentence pairs"):
        bias.compute_bias_extras(ds, _bias_config(source="features"))


def test_fit_is_fast_and_matches_sklearn():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10_000, 10))
    y = np.argmax(x @ rng.normal(size=(10, 3)) + rng.gumbel(size=(10_000, 3)), 1)
    start = time.perf_counter()
    model = bias.fit_logistic_regression(x, y, num_classes=3, l2=1.0)
    assert time.perf_counter() - start < 2.0 and model.converged  # ~0.2 s
    sklearn = pytest.importorskip("sklearn.linear_model")
    x = rng.normal(size=(2000, 6))
    y = np.argmax(x @ rng.normal(size=(6, 3)) + rng.gumbel(size=(2000, 3)), 1)
    model = bias.fit_logistic_regression(x, y, num_classes=3, l2=0.5)
    ref = sklearn.LogisticRegression(
        C=2.0, class_weight="balanced", tol=1e-10, max_iter=1000
    ).fit(x, y)
    np.testing.assert_allclose(
        bias.predict_log_probs(model, x), ref.predict_log_proba(x), atol=1e-4
    )


def test_features_binary_positive_on_mnli_file(tmp_path, tokenizer):
    pairs = [
        ("The doctor saw the lawyer .", "the lawyer", "entailment"),
        ("A cat sat on the mat .", "A cat sat", "entailment"),
        ("The judge ran quickly home .", "The judge ran", "entailment"),
        ("Birds fly south in winter .", "Birds fly", "entailment"),
        ("The doctor saw the lawyer .", "The lawyer saw the doctor", "contradiction"),
        ("A cat sat on the mat .", "A dog barked loudly", "neutral"),
        ("The judge ran quickly home .", "Nobody moved at all", "contradiction"),
        ("Birds fly south in winter .", "Fish swim in lakes", "neutral"),
        ("It rained all day long .", "It rained", "neutral"),
    ]
    train = _mnli_file(tmp_path / "train.tsv", pairs)
    dev = _mnli_file(tmp_path / "dev.tsv", pairs[::-1])
    c = data.default_data_config()
    c.source = "mnli"
    c.splits = ("train", "dev")
    c.split_files.train, c.split_files.dev = train, dev
    c.max_examples_per_split = 8  # the model is fitted on the 8 kept rows
    c.bias.source = "features"
    c.bias.binary_positive = "entailment"
    c.bias.l2 = 0.1
    c.max_length = 16
    ds = data.build_dataset(c, tokenizer)
    lp = ds.splits["train"].extras["bias_logprobs"]
    assert lp.shape == (8, 3) and ds.splits["dev"].extras["bias_logprobs"].shape == (
        8,
        3,
    )
    # By hand: the 2-class model on the word-overlap features of the kept rows.
    kept = pairs[:8]
    feats = nli.word_overlap_features([p for p, _, _ in kept], [h for _, h, _ in kept])
    y2 = np.array([lab == "entailment" for _, _, lab in kept])
    model = bias.fit_logistic_regression(feats, y2, num_classes=2, l2=0.1)
    v = bias.predict_log_probs(model, feats).astype(np.float64)
    expected = np.stack([v[:, 0] - np.log(2), v[:, 1], v[:, 0] - np.log(2)], 1)
    np.testing.assert_array_equal(lp, expected.astype(np.float32))
    np.testing.assert_allclose(np.exp(lp).sum(1), 1, atol=1e-6)
    assert lp[0, 1] > lp[0, 0] and lp[5, 0] > lp[5, 1]  # overlap -> entailment
    assert ds.bias_summary["model_classes"] == ["not entailment", "entailment"]
    assert data.summarize_dataset(ds)["bias"]["splits"]["dev"]["num_examples"] == 8
    c.bias.binary_positive = "maybe"
    with pytest.raises(ValueError, match="not a task class"):
        data.load_text_dataset(c)
    with pytest.raises(ValueError, match="positive must be"):
        bias.expand_binary_log_probs(v, positive=3, num_classes=3)


def _csv_with_gender(path, n):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["text", "y", "g"])
        w.writeheader()
        for i in range(n):
            # gender f is rare among label "a" -> balancing upsamples it.
            g = "f" if i in (0, 3) else "m"
            w.writerow({"text": f"row {i}", "y": "ab"[i % 2], "g": g})
    return str(path)


def test_file_source_alignment_and_errors(tmp_path):
    n = 8
    train = _csv_with_gender(tmp_path / "train.csv", n)
    probs = np.stack([np.arange(n) / 10, 1 - np.arange(n) / 10], 1)  # row id
    np.save(tmp_path / "p.npy", probs)
    np.save(tmp_path / "lp.npy", np.log(probs + 1e-9).astype(np.float32))
    c = data.default_data_config()
    c.source = "tabular"
    c.splits = ("train",)
    c.split_files.train = train
    c.columns.text, c.columns.task = "text", "y"
    c.attributes = ("gender",)
    c.columns.attributes = {"gender": "g"}
    c.bias.source = "file"
    c.bias.files.train = str(tmp_path / "p.npy")
    c.bias.file_kind = "probs"
    c.max_examples_per_split = 6
    c.balance.attribute = "gender"
    ds = data.load_text_dataset(c)
    tr = ds.splits["train"]
    assert len(tr) > 6  # upsampled
    rows = np.array([int(t.split()[1]) for t in tr.text])
    np.testing.assert_allclose(
        np.exp(tr.extras["bias_logprobs"]), probs[rows], atol=1e-6
    )
    assert ds.bias_summary["splits"]["train"]["num_examples"] == len(tr)
    c.bias.files.train, c.bias.file_kind = str(tmp_path / "lp.npy"), "log_probs"
    np.testing.assert_allclose(
        np.exp(data.load_text_dataset(c).splits["train"].extras["bias_logprobs"]),
        probs[rows],
        atol=1e-6,
    )
    np.save(tmp_path / "short.npy", probs[:5])
    c.bias.files.train = str(tmp_path / "short.npy")
    with pytest.raises(ValueError, match=r"short\.npy.*\[5, 2\], expected \[8, 2\]"):
        data.load_text_dataset(c)
    c.bias.files.train, c.bias.file_kind = str(tmp_path / "p.npy"), "log_probs"
    with pytest.raises(ValueError, match="positive log-probabilities"):
        data.load_text_dataset(c)
    np.save(tmp_path / "bad.npy", probs * 0.5)
    c.bias.files.train, c.bias.file_kind = str(tmp_path / "bad.npy"), "probs"
    with pytest.raises(ValueError, match="do not sum to 1"):
        data.load_text_dataset(c)
    c.bias.files.train = str(tmp_path / "missing.npy")
    with pytest.raises(FileNotFoundError, match="data.bias.files.train"):
        data.load_text_dataset(c)
    c.bias.files.train = ""
    with pytest.raises(ValueError, match="needs data.bias.files.train"):
        data.load_text_dataset(c)


def test_bias_aligned():
    lp = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.4, 0.4, 0.2]]))
    np.testing.assert_array_equal(
        bias.bias_aligned(lp, [0, 1, 1]), [True, False, False]
    )
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        bias.bias_aligned(lp[0], [0])


# ---------------------------------------------------------------- OOD


def _hans_file(path):
    rows = [  # gold, heuristic
        ("entailment", "lexical_overlap"),
        ("entailment", "subsequence"),
        ("non-entailment", "lexical_overlap"),
        ("non-entailment", "lexical_overlap"),
        ("non-entailment", "subsequence"),
        ("non-entailment", "constituent"),
    ]
    return _write_tsv(
        path,
        HANS_HEADER,
        [
            [g, "", "", "", "", f"The actor {i} ran .", "The actor ran .", f"ex{i}"]
            + [h, "sub", "temp"]
            for i, (g, h) in enumerate(rows)
        ],
    )


def _entry(source, path, label_map=""):
    e = ood.default_ood_entry()
    assert not e.enabled  # disabled until given a file
    e.source, e.path, e.label_map, e.enabled = source, path, label_map, True
    return e


def test_hans_mnli_to_hans(tmp_path, tokenizer):
    path = _hans_file(tmp_path / "heuristics_evaluation_set.txt")
    cfg = ml_collections.ConfigDict({"hans": _entry("hans", path, "mnli_to_hans")})
    cfg.off = _entry("hans", str(tmp_path / "nope.txt"))
    cfg.off.enabled = False
    sets = ood.load_ood_sets(
        cfg, tokenizer, max_length=16, task_classes=nli.MNLI_CLASSES
    )
    assert list(sets) == ["hans"]
    hans = sets["hans"]
    assert hans.classes == ("non-entailment", "entailment") and len(hans) == 6
    assert hans.split.input_ids.shape == (6, 16)
    assert hans.meta["guid"][2] == "ex2"
    # MNLI predictions: contradiction 0, entailment 1, neutral 2.
    pred = np.array([1, 2, 0, 1, 2, 1])
    # mapped: [1, 0, 0, 1, 0, 1]; gold: [1, 1, 0, 0, 0, 0]; correct: rows 0, 2, 4.
    m = ood.ood_metrics(hans, pred)
    assert m["accuracy"] == pytest.approx(3 / 6)
    assert m["entailment"] == pytest.approx(1 / 2)
    assert m["non-entailment"] == pytest.approx(2 / 4)
    assert m["entailment/lexical_overlap"] == 1.0
    assert m["entailment/subsequence"] == 0.0
    assert m["non-entailment/lexical_overlap"] == pytest.approx(1 / 2)
    assert m["non-entailment/subsequence"] == 1.0
    assert m["non-entailment/constituent"] == 0.0
    assert np.isnan(m["entailment/constituent"])
    assert m["lexical_overlap"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="6 examples"):
        ood.ood_metrics(hans, pred[:5])
    # Identity map with HANS classes that an MNLI model does not have.
    with pytest.raises(ValueError, match=r"eval\.ood\.hans\.label_map"):
        ood.load_ood_sets(
            ml_collections.ConfigDict({"hans": _entry("hans", path)}),
            tokenizer,
            max_length=16,
            task_classes=nli.MNLI_CLASSES,
        )
    with pytest.raises(FileNotFoundError, match=r"eval\.ood\.x\.path.*nope\.txt"):
        ood.load_ood_set(
            "x",
            _entry("hans", str(tmp_path / "nope.txt")),
            tokenizer,
            max_length=16,
            task_classes=nli.MNLI_CLASSES,
        )


def test_entry_source_defaults_to_name():
    e = ood.default_ood_entry()
    assert ood.entry_source("paws", e) == "paws"
    e.source = "fever_symmetric"
    assert ood.entry_source("sym2", e) == "fever_symmetric"
    with pytest.raises(ValueError, match=r"eval\.ood\.sym2\.source to one of"):
        ood.entry_source("sym2", ood.default_ood_entry())


def test_label_maps():
    np.testing.assert_array_equal(
        ood.prediction_map("", task_classes=("b", "a", "c"), ood_classes=("a", "b")),
        [1, 0, -1],
    )
    fever = ood.prediction_map(
        "", task_classes=nli.FEVER_CLASSES, ood_classes=nli.FEVER_CLASSES
    )
    np.testing.assert_array_equal(fever, [0, 1, 2])
    with pytest.raises(ValueError, match="valid: \\['', 'mnli_to_hans'\\]"):
        ood.prediction_map("hans", task_classes=("a",), ood_classes=("a",))
    with pytest.raises(ValueError, match="only for an MNLI model"):
        ood.prediction_map(
            "mnli_to_hans", task_classes=("0", "1"), ood_classes=nli.HANS_CLASSES
        )


def _paws(tmp_path, tokenizer):
    gold = ["1", "1", "0", "0", "0", "0", "1"]
    path = _write_tsv(
        tmp_path / "dev.tsv",
        ["id", "sentence1", "sentence2", "label"],
        [[str(i), f"a {i}", f"b {i}", g] for i, g in enumerate(gold)],
    )
    return ood.load_ood_set(
        "paws_qqp",
        _entry("paws", path),
        tokenizer,
        max_length=12,
        task_classes=nli.QQP_CLASSES,
    )


def test_paws_f1s(tmp_path, tokenizer):
    paws = _paws(tmp_path, tokenizer)
    # gold [1,1,0,0,0,0,1], pred [1,0,0,1,0,0,1]: TP 2, FN 1, FP 1, TN 3.
    m = ood.ood_metrics(paws, np.array([1, 0, 0, 1, 0, 0, 1]))
    assert m["accuracy"] == pytest.approx(5 / 7)
    assert m["f1"] == pytest.approx(4 / 6)
    assert m["non_duplicate_f1"] == pytest.approx(6 / 8)
    assert m["average_f1"] == pytest.approx((3 * 4 / 6 + 4 * 6 / 8) / 7)
    assert m["duplicate_acc"] == pytest.approx(2 / 3)
    assert m["non_duplicate_acc"] == pytest.approx(3 / 4)
    none = ood.ood_metrics(paws, np.zeros(7, int))
    assert none["f1"] == 0.0 and none["duplicate_acc"] == 0.0


# ---------------------------------------------------------------- evaluation


def test_ood_and_bias_rows_and_report(tmp_path, tokenizer):
    paws = _paws(tmp_path, tokenizer)
    lp = np.log(np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]]))
    dev = _index_split(4, {"bias_logprobs": lp})
    dev = data.TokenizedSplit(
        input_ids=dev.input_ids,
        attention_mask=dev.attention_mask,
        token_type_ids=dev.token_type_ids,
        task=np.array([0, 0, 1, 1], np.int32),  # aligned: rows 0, 3
        attrs={},
        extras=dev.extras,
    )
    ds = data.TokenizedDataset(
        splits={"dev": dev, "test": _index_split(4)},
        task_classes=("0", "1"),
        attr_classes={},
        name="qqp",
        synthetic=False,
        max_length=4,
    )
    config = ml_collections.ConfigDict({"eval": {"batch_size": 4}})
    ctx = types.SimpleNamespace(config=config, data=ds)
    assert composition.load_run_ood_sets(config, ds.task_classes) == {}

    def predict(params, split):
        if len(split) == 7:
            return np.array(params["paws"])
        return np.array(params["run"])

    params = {
        "core": {"run": [0, 1, 1, 1], "paws": [1, 0, 0, 1, 0, 0, 1]},
        "core+x": {"run": [0, 0, 0, 0], "paws": [0] * 7},
    }
    rows = composition.ood_and_bias_rows(
        ctx, predict, params, ood_sets={"paws_qqp": paws}
    )
    core = rows["core"]
    # aligned rows 0, 3 both right; conflicting rows 1 (wrong), 2 (right).
    assert core["dev_bias_aligned_acc"] == 1.0
    assert core["dev_bias_conflicting_acc"] == 0.5
    assert "test_bias_aligned_acc" not in core  # test has no bias log-probs
    assert core["ood"]["paws_qqp"]["f1"] == pytest.approx(4 / 6)
    assert rows["core+x"]["dev_bias_aligned_acc"] == 0.5
    # The report shows the new columns and the OOD breakdown.
    task = {"accuracy": 0.5, "macro_f1": 0.5}
    results = {
        "method": "srnets",
        "dataset": "qqp",
        "attributes": [],
        "probe_config": {"members": 1, "seeds": [0]},
        "ood_sets": {"paws_qqp": {}},
        "composition": {
            label: {
                "dev_task_acc": 0.5,
                "test_task_acc": 0.5,
                "task": {"dev": task, "test": task},
                "leakage": {},
                **extra,
            }
            for label, extra in rows.items()
        },
    }
    report = composition.format_report(json.loads(json.dumps(results)))
    header = next(x for x in report.splitlines() if x.startswith("| configuration"))
    for col in (
        "dev aligned acc",
        "dev conflicting acc",
        "paws_qqp acc",
        "paws_qqp F1",
    ):
        assert col in header
    assert "| core | 0.500 | 0.500 | 0.500 | 1.000 | 0.500 | 0.714 | 0.667 |" in report
    assert "## OOD set paws_qqp" in report and "non_duplicate_f1" in report
    # Old results (no bias, no OOD) keep the old table.
    for row in results["composition"].values():
        row.pop("ood")
        row.pop("dev_bias_aligned_acc"), row.pop("dev_bias_conflicting_acc")
        row.pop("dev_bias_unbiased_acc", None)
    results.pop("ood_sets")
    old = composition.format_report(results)
    assert "aligned" not in old and "OOD" not in old
    assert "| configuration | dev acc | test acc | test macro-F1 |" in old
    assert "task lost" not in old
    # A row far under the core's task accuracy is marked (stop 63), one
    # within TASK_LOST is not, and the core never is.
    results["composition"]["core"]["test_task_acc"] = 0.9
    results["composition"]["core+x"]["test_task_acc"] = 0.6
    marked = composition.format_report(results)
    assert "| core+x (task lost: 30.0 points under the core) | 0.500 | 0.600 |" in (
        marked
    )
    assert "*task lost*: core+x read(s) more than 10 points" in marked
    results["composition"]["core+x"]["test_task_acc"] = 0.81
    assert "task lost" not in composition.format_report(results)
