"""Helpers shared by test modules."""

import json
import os

import numpy as np

from moddiffy_jax import checkpoints
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.methods.word_rows import WORD_TABLE
from moddiffy_jax.subnets import diffs, selection


def tiny(method, arg="", **overrides):
    """The tiny config of ``method`` (``arg``: more ``key=value`` arguments;
    ``overrides``: dotted config fields, e.g. ``**{"method.core_run": d}``)."""
    config = experiment_config(method, ",".join(filter(None, ["model=tiny", arg])))
    return set_fields(config, overrides)


def set_fields(config, overrides):
    """``config`` with the dotted fields of ``overrides`` set (in place)."""
    with config.unlocked():
        for key, value in overrides.items():
            node = config
            *parents, last = key.split(".")
            for p in parents:
                node = node[p]
            node[last] = value
    return config


def cli_env(devices: int) -> dict:
    """This process's environment for a command-line subprocess that sees
    ``devices`` CPU devices."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count", "--ignored_device_count"
    )
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    return env


# The tiny MoDDiffy-par run through the command line (no leakage probes).
TINY_PAR_CLI = [
    "-m",
    "moddiffy_jax.main",
    "--config=configs/tiny.py:moddiffy_par",
    "--config.eval.leakage=False",
]


def exported_diffs(workdir):
    """The exported diff files of a run, sorted by name."""
    return sorted((workdir / "export" / "diffs").glob("*.safetensors"))


def exported_corrections(workdir):
    """The exported corrections of compositions (``export/joint``), sorted."""
    return sorted((workdir / "export" / "joint").glob("*.safetensors"))


def check_run(workdir, results, method):
    """Checks what every finished tiny run writes; returns its exported core."""
    assert (workdir / "config.json").is_file()
    assert (workdir / "results.json").is_file()
    assert json.loads((workdir / "results.json").read_text())["method"] == method
    assert results["synthetic"] is True
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert any("task/loss" in r or "debias/gender/loss" in r for r in records)
    # Exports get the permissions a plain open() would give (shareable runs).
    umask = os.umask(0)
    os.umask(umask)
    for path in (workdir / "export").rglob("*.safetensors"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    core, meta = checkpoints.load_params(workdir / "export" / "core.safetensors")
    assert meta["fingerprint"] == diffs.fingerprint(core)
    for row in results["composition"].values():
        for value in row.values():
            assert 0.0 <= value <= 1.0
    return core


def planted_split(n, seed, attr_words=None):
    """Each example: one task token (10 / 11), one attribute token (20 / 21,
    independent of the task; with ``attr_words``, drawn uniformly from
    ``attr_words[attribute]``) and three filler tokens (30-39)."""
    from moddiffy_jax.data.dataset import TokenizedSplit

    rng = np.random.default_rng(seed)
    task = rng.integers(0, 2, n).astype(np.int32)
    attr = rng.integers(0, 2, n).astype(np.int32)
    word = 20 + attr
    if attr_words is not None:
        drawn = [rng.choice(list(words), n) for words in attr_words]
        word = np.choose(attr, drawn)
    ids = np.concatenate(
        [(10 + task)[:, None], word[:, None], rng.integers(30, 40, (n, 3))],
        axis=1,
    ).astype(np.int32)
    return TokenizedSplit(
        input_ids=ids,
        attention_mask=np.ones_like(ids),
        token_type_ids=np.zeros_like(ids),
        task=task,
        attrs={"a": attr},
    )


def bag_of_rows(params, split):
    """A stand-in encoder: the mean of the examples' word rows."""
    table = np.asarray(selection.flatten(params)[WORD_TABLE])
    return table[split.input_ids].mean(1)


def core_prediction(ctx, trainable, frozen, batch):
    """The core's task log-probabilities on ``batch`` (L0 phase, eval mode,
    no diff): the debias losses' teacher."""
    from moddiffy_jax.methods import common

    return common._core_prediction(
        ctx.model,
        ctx.method,
        trainable,
        frozen,
        batch,
        phase="l0",
        settings=ctx.diff_settings,
    )
