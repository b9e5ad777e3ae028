"""LoRA and LoRA-debias: the method added through the Method interface alone."""

import json

import jax
import ml_collections
import numpy as np
import pytest

from moddiffy_jax import checkpoints, train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.methods import lora, registry
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import selection
from tests.helpers import tiny

leaves = jax.tree.leaves


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("finetune")
    train.train_and_evaluate(tiny("finetune"), workdir)
    return workdir


def test_registry_finds_the_family_and_its_config_section():
    assert {"lora", "lora_debias"} <= set(registry.METHODS)
    assert lora in registry.FAMILIES
    assert tuple(experiment_config("lora", "model=tiny").lora.include) == (
        lora.DEFAULT_INCLUDE
    )
    # Only the method that reads the section carries it.
    assert "lora" not in experiment_config("finetune", "model=tiny")


def test_module_starts_at_the_base_and_merges_to_its_update():
    ctx = train.build_context(tiny("lora"))
    trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    module = trainable["task_diff"]
    paths = selection.flatten(module["a"]).keys()
    assert paths and all("attention/self/" in p for p in paths)
    params, head = lora.encoder_and_head(
        ctx.method, trainable, frozen, "train", None, None, None, train=False
    )
    for x, y in zip(leaves(params), leaves(frozen["base"]), strict=True):
        np.testing.assert_array_equal(x, y)  # B = 0: training starts at the base
    # A non-zero module adds scale * A @ B, and its export is that update.
    module = jax.tree.map(lambda b: b + 0.1, module)
    trainable = {**trainable, "task_diff": module}
    params, _ = lora.encoder_and_head(
        ctx.method, trainable, frozen, "train", None, None, None, train=False
    )
    flat, base = selection.flatten(params), selection.flatten(frozen["base"])
    a, b = selection.flatten(module["a"]), selection.flatten(module["b"])
    scale = ctx.config.lora.alpha / ctx.config.lora.rank
    for p in a:
        want = base[p] + scale * (a[p] @ b[p])
        np.testing.assert_allclose(flat[p], want, rtol=1e-5, atol=1e-6)
    sd = ctx.method.exports(ctx, trainable, frozen, "train")["task"]
    merged = diffs_lib.apply_diffs(frozen["base"], [sd])
    for x, y in zip(leaves(merged), leaves(params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_lora_trains_and_exports_a_task_diff(tmp_path):
    results = train.train_and_evaluate(tiny("lora"), tmp_path)
    core, _ = checkpoints.load_params(tmp_path / "export" / "core.safetensors")
    ctx = train.build_context(tiny("lora"))
    for x, y in zip(leaves(core), leaves(ctx.pretrained), strict=True):
        np.testing.assert_array_equal(x, y)  # the encoder stayed frozen
    sd = diffs_lib.load_sparse_diff(
        tmp_path / "export" / "diffs" / "task.safetensors", base=core
    )
    selected = selection.select_paths(core, lora.DEFAULT_INCLUDE)
    n = sum(int(np.size(selection.flatten(core)[p])) for p in selected)
    assert sd.num_selected() == n and sd.nnz() > 0.99 * n  # dense on its kernels
    assert results["diffs"]["task"]["nnz"] == sd.nnz()
    assert set(results["composition"]) == {"core"}


def test_lora_debias_modules_compose_on_the_frozen_core(finetune_run, tmp_path):
    config = tiny("lora_debias", **{"method.core_run": str(finetune_run)})
    results = train.train_and_evaluate(config, tmp_path)
    ft_core, _ = checkpoints.load_params(finetune_run / "export" / "core.safetensors")
    core, _ = checkpoints.load_params(tmp_path / "export" / "core.safetensors")
    for x, y in zip(leaves(core), leaves(ft_core), strict=True):
        np.testing.assert_array_equal(x, y)
    files = sorted((tmp_path / "export" / "diffs").glob("*.safetensors"))
    assert [f.stem for f in files] == ["age", "gender"]
    diffs = [diffs_lib.load_sparse_diff(f, base=ft_core) for f in files]
    assert all(d.nnz() > 0 for d in diffs)  # every module moved
    assert set(results["composition"]) == {
        "core",
        "core+gender",
        "core+age",
        "core+gender+age",
    }
    # The exported files reproduce the run's composition table.
    ctx = train.build_context(config)
    head, _ = checkpoints.load_params(tmp_path / "export" / "task_head.safetensors")
    evaluator = train.Evaluator(ctx)
    both = evaluator.compose(core, diffs)
    acc = evaluator.task_accuracy(both, head, "dev")
    row = results["composition"]["core+gender+age"]
    assert acc == pytest.approx(row["dev_task_acc"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(x) for x in lines]
    assert any("debias/gender/mmd/gender" in m for m in metrics)


def test_bad_lora_configs_name_the_problem(finetune_run, tmp_path):
    with pytest.raises(ValueError, match="config.lora.rank=0"):
        train.build_context(tiny("lora", **{"lora.rank": 0}))
    ctx = train.build_context(tiny("lora", **{"lora.include": ("nothing/.*",)}))
    with pytest.raises(ValueError, match="nothing/.* matches no parameter"):
        ctx.method.init(ctx, jax.random.PRNGKey(0))
    ctx = train.build_context(tiny("lora", **{"lora.include": (r".*LayerNorm.*",)}))
    with pytest.raises(ValueError, match="2-D kernels"):
        ctx.method.init(ctx, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="core_run"):
        train.train_and_evaluate(tiny("lora_debias"), tmp_path)


def test_config_file_picks_the_method(tmp_path):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "lora.py"
    spec = importlib.util.spec_from_file_location("lora_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_config().method.name == "lora"
    c = module.get_config("method=lora_debias,model=tiny")
    assert c.method.name == "lora_debias"
    assert isinstance(c.lora, ml_collections.ConfigDict)
    with pytest.raises(ValueError, match="method='lorax'"):
        module.get_config("method=lorax")
