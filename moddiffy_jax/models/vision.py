"""Vision backbones for the FFW benchmarks (spec B9) and the model wrapper.

Backbones map NHWC images ``[B, H, W, C]`` to pooled features ``[B, F]``:

- :class:`SimpleConvNet` (Biased MNIST): 4 x [Conv 7x7 pad 3 -> BatchNorm ->
  act] with 16, 32, 64, 128 channels and acts ReLU, ReLU, ReLU, Tanh, then
  global average pooling; F = 128.
- :class:`ResNet18` (CelebA, Corrupted CIFAR-10): the torchvision layout
  (7x7 stride-2 stem, 3x3 max pool, 4 stages of 2 BasicBlocks, widths 64..512,
  global average pooling); F = 512. ``small_stem`` swaps the stem for a 3x3
  stride-1 conv without max pool, for small images.
- :class:`MLP` (Multi-Color MNIST): flatten -> 3 x (Dense 100 + ReLU); F = 100.
  The input is the normalised image batch; it is not divided by 255 again
  (the reference does, spec B13.5).

The task classifier (the reference ``fc``) is a separate ``Dense(C)`` head on
the features, with torch ``nn.Linear`` init.

:class:`VisionModel` has the duck type of
:class:`moddiffy_jax.models.text.TextModel`. Its "encoder params" are the
Flax variables ``{"params": ..., "batch_stats": ...}`` (``batch_stats`` is
``{}`` for the MLP), so paths read ``params/conv_0/kernel``,
``params/bn_0/scale``, ``batch_stats/bn_0/mean``.

Parameter names (stable; :meth:`VisionModel.structured_followers` relies on
"a conv named ``*conv*`` is followed by the BatchNorm of the same name with
``conv`` replaced by ``bn``"):

- SimpleConvNet: ``conv_{i}/{kernel,bias}``, ``bn_{i}/{scale,bias}``.
- ResNet18: ``stem_conv/kernel``, ``stem_bn``, and per block
  ``stage_{s}_block_{b}/{conv_0,bn_0,conv_1,bn_1}`` plus
  ``downsample_conv``/``downsample_bn`` where the shape changes.
- MLP: ``dense_{i}/{kernel,bias}``.

Initialisation as torch: conv kernels Kaiming-normal (fan_out, ReLU gain),
torch-default conv biases (SimpleConvNet only; the ResNet convs have none),
BatchNorm scale 1 / bias 0, momentum 0.1 (Flax ``momentum=0.9``), eps 1e-5,
Dense layers torch ``nn.Linear`` default.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moddiffy_jax.models.heads import torch_dense, torch_linear_bias_init
from moddiffy_jax.subnets import selection

Dtype = Any
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": nn.relu,
    "tanh": jnp.tanh,
    "gelu": nn.gelu,
    "identity": lambda x: x,
}
ARCHS = ("simple_convnet", "resnet18", "mlp")
DEFAULT_WIDTHS = {
    "simple_convnet": (16, 32, 64, 128),
    "resnet18": (64, 128, 256, 512),
    "mlp": (100, 100, 100),
}
# Every conv/dense kernel of the encoder variables; never biases, BatchNorm
# affine parameters or batch statistics (FFW gates every non-BN ``.weight``).
PRUNABLE_RULE = r"params/(.+/)?kernel"


def kaiming_normal_fan_out() -> nn.initializers.Initializer:
    """torch ``kaiming_normal_(mode="fan_out", nonlinearity="relu")``.

    ``N(0, 2 / fan_out)`` with ``fan_out = kh * kw * out`` for a Flax conv
    kernel ``[kh, kw, in, out]``.
    """
    return nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def _batch_norm(train: bool, name: str, dtype: Dtype) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        dtype=dtype,
        name=name,
    )


class SimpleConvNet(nn.Module):
    """ReBias/FFW SimpleConvNet backbone (spec B9).

    Attributes:
      widths: output channels of the conv layers.
      activations: one :data:`ACTIVATIONS` name per layer.
      kernel_size: square kernel side; padding ``kernel_size // 2`` keeps the
        spatial size.
      dtype: compute dtype.
    """

    widths: Sequence[int] = (16, 32, 64, 128)
    activations: Sequence[str] = ("relu", "relu", "relu", "tanh")
    kernel_size: int = 7
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        """Images ``[B, H, W, C]`` -> features ``[B, widths[-1]]``."""
        if len(self.widths) != len(self.activations):
            raise ValueError(
                f"SimpleConvNet has {len(self.widths)} widths but "
                f"{len(self.activations)} activations; give one per layer."
            )
        k, pad = self.kernel_size, self.kernel_size // 2
        for i, (width, act) in enumerate(
            zip(self.widths, self.activations, strict=True)
        ):
            x = nn.Conv(
                width,
                (k, k),
                padding=((pad, pad), (pad, pad)),
                kernel_init=kaiming_normal_fan_out(),
                bias_init=torch_linear_bias_init(x.shape[-1] * k * k),
                dtype=self.dtype,
                name=f"conv_{i}",
            )(x)
            x = _batch_norm(train, f"bn_{i}", self.dtype)(x)
            x = ACTIVATIONS[act](x)
        return jnp.mean(x, axis=(1, 2))


class BasicBlock(nn.Module):
    """torchvision ResNet BasicBlock (expansion 1, no conv biases).

    Attributes:
      features: output channels.
      strides: stride of the first conv (and of the downsample).
      dtype: compute dtype.
    """

    features: int
    strides: int = 1
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        conv = functools.partial(
            nn.Conv,
            use_bias=False,
            kernel_init=kaiming_normal_fan_out(),
            dtype=self.dtype,
        )
        s = (self.strides, self.strides)
        y = conv(self.features, (3, 3), s, padding=((1, 1), (1, 1)), name="conv_0")(x)
        y = nn.relu(_batch_norm(train, "bn_0", self.dtype)(y))
        y = conv(self.features, (3, 3), padding=((1, 1), (1, 1)), name="conv_1")(y)
        y = _batch_norm(train, "bn_1", self.dtype)(y)
        residual = x
        if self.strides != 1 or x.shape[-1] != self.features:
            residual = conv(self.features, (1, 1), s, name="downsample_conv")(x)
            residual = _batch_norm(train, "downsample_bn", self.dtype)(residual)
        return nn.relu(y + residual)


class ResNet18(nn.Module):
    """torchvision ResNet-18 backbone without its ``fc`` (spec B9).

    Attributes:
      widths: channels per stage (64, 128, 256, 512).
      stage_sizes: BasicBlocks per stage (2, 2, 2, 2); smaller for tests.
      small_stem: 3x3 stride-1 stem conv without max pool (small images),
        instead of the 7x7 stride-2 conv and 3x3 stride-2 max pool.
      dtype: compute dtype.
    """

    widths: Sequence[int] = (64, 128, 256, 512)
    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    small_stem: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        """Images ``[B, H, W, C]`` -> features ``[B, widths[-1]]``."""
        if len(self.widths) != len(self.stage_sizes):
            raise ValueError(
                f"ResNet18 has {len(self.widths)} widths but {len(self.stage_sizes)} "
                "stage_sizes; give one per stage."
            )
        if self.small_stem:
            stem = dict(kernel_size=(3, 3), strides=(1, 1), padding=((1, 1), (1, 1)))
        else:
            stem = dict(kernel_size=(7, 7), strides=(2, 2), padding=((3, 3), (3, 3)))
        x = nn.Conv(
            self.widths[0],
            use_bias=False,
            kernel_init=kaiming_normal_fan_out(),
            dtype=self.dtype,
            name="stem_conv",
            **stem,
        )(x)
        x = nn.relu(_batch_norm(train, "stem_bn", self.dtype)(x))
        if not self.small_stem:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for s, (width, blocks) in enumerate(
            zip(self.widths, self.stage_sizes, strict=True)
        ):
            for b in range(blocks):
                x = BasicBlock(
                    width,
                    strides=2 if s > 0 and b == 0 else 1,
                    dtype=self.dtype,
                    name=f"stage_{s}_block_{b}",
                )(x, train=train)
        return jnp.mean(x, axis=(1, 2))


class MLP(nn.Module):
    """FFW Multi-Color MNIST extractor: flatten -> (Dense + ReLU) per width.

    Attributes:
      widths: hidden widths (100, 100, 100).
      dtype: compute dtype.
    """

    widths: Sequence[int] = (100, 100, 100)
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        """Images ``[B, H, W, C]`` -> features ``[B, widths[-1]]``."""
        del train
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.widths):
            x = torch_dense(
                width, fan_in=x.shape[-1], name=f"dense_{i}", dtype=self.dtype
            )(x)
            x = nn.relu(x)
        return x


@dataclasses.dataclass(frozen=True)
class VisionModel:
    """Static modules of an image classifier; every method takes params explicitly.

    ``params`` of the encoder methods are the Flax variables
    ``{"params": ..., "batch_stats": ...}`` from :meth:`init_encoder`.

    Attributes:
      backbone: the feature extractor (``__call__(x, *, train)``).
      task_head: ``Dense(C)`` on the features (the reference ``fc``).
      feature_dim: ``F``, the width of the pooled features.
      image_shape: ``(H, W, C)`` of the inputs.
      stateful: True when the backbone has BatchNorm running statistics.
      prunable_rule: regex over "/"-joined encoder variable paths selecting
        every conv/dense kernel (no biases, BatchNorm or statistics).
    """

    backbone: nn.Module
    task_head: nn.Module
    feature_dim: int
    image_shape: tuple[int, int, int]
    stateful: bool = True
    prunable_rule: str = PRUNABLE_RULE

    def _variables(self, params: Mapping[str, Any]) -> dict[str, Any]:
        if "params" not in params:
            raise ValueError(
                "VisionModel encoder params must be the variables dict "
                "{'params': ..., 'batch_stats': ...} from init_encoder; got keys "
                f"{sorted(params)}."
            )
        variables = {"params": params["params"]}
        if self.stateful:
            variables["batch_stats"] = params["batch_stats"]
        return variables

    def init_encoder(self, rng: jax.Array) -> dict[str, Any]:
        """Initial variables ``{"params": ..., "batch_stats": ...}``.

        ``batch_stats`` holds BatchNorm ``mean`` (0) and ``var`` (1) per BN
        layer; it is ``{}`` for a backbone without BatchNorm.
        """
        x = jnp.zeros((1, *self.image_shape), jnp.float32)
        variables = flax.core.unfreeze(self.backbone.init(rng, x, train=False))
        return {
            "params": variables["params"],
            "batch_stats": variables.get("batch_stats", {}),
        }

    def represent(
        self,
        params: Mapping[str, Any],
        batch: Mapping[str, Any],
        rng: jax.Array | None,
        train: bool,
    ) -> jax.Array:
        """Pooled features ``[B, F]`` (float32) of ``batch["image"]`` ``[B, H, W, C]``.

        ``train=False`` normalises with the BatchNorm running statistics;
        ``train=True`` with the batch statistics, without updating the
        running ones (use :meth:`represent_with_state` for that). ``rng`` is
        unused (no dropout).
        """
        del rng
        variables = self._variables(params)
        if train and self.stateful:
            h, _ = self.backbone.apply(
                variables, batch["image"], train=True, mutable=["batch_stats"]
            )
        else:
            h = self.backbone.apply(variables, batch["image"], train=train)
        return h.astype(jnp.float32)

    def represent_with_state(
        self, params: Mapping[str, Any], batch: Mapping[str, Any], rng: jax.Array | None
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Train-mode features ``[B, F]`` and the updated ``batch_stats``.

        The new running statistics are ``0.9 * old + 0.1 * batch`` (torch
        momentum 0.1); ``{}`` for a backbone without BatchNorm.
        """
        del rng
        if not self.stateful:
            return self.represent(params, batch, None, True), {}
        h, updates = self.backbone.apply(
            self._variables(params),
            batch["image"],
            train=True,
            mutable=["batch_stats"],
        )
        return h.astype(jnp.float32), flax.core.unfreeze(updates)["batch_stats"]

    def task_logits(
        self,
        head_params: Mapping[str, Any],
        h: jax.Array,
        rng: jax.Array | None,
        train: bool,
    ) -> jax.Array:
        """Task logits ``[B, C]`` (float32) from features ``[B, F]``."""
        del rng, train
        return self.task_head.apply({"params": head_params}, h).astype(jnp.float32)

    def init_task_head(self, rng: jax.Array) -> dict[str, Any]:
        """The head's params ``{"kernel": [F, C], "bias": [C]}``."""
        h = jnp.zeros((1, self.feature_dim), jnp.float32)
        return dict(flax.core.unfreeze(self.task_head.init(rng, h))["params"])

    def structured_followers(
        self, encoder_params: Mapping[str, Any]
    ) -> dict[str, tuple[str, ...]]:
        """Per-output-channel leaves to gate together with each prunable kernel.

        For a kernel ``.../<name>/kernel`` with ``out`` output channels: the
        layer's own ``.../<name>/bias`` (if any) and, for a conv, the
        ``scale`` and ``bias`` of the BatchNorm ``.../<name with conv -> bn>``
        that follows it. Multiplying the kernel's output channel and these
        ``[out]`` leaves by a gate ``g`` equals multiplying the layer's
        post-BatchNorm output by ``g`` (in eval mode, and in train mode for the
        BN affine part), and therefore, for ReLU/Tanh, the post-activation
        output: ``g = 0`` removes the channel. In a ResNet block this removes
        the channel from the residual branch (or the shortcut); the identity
        path still carries the block input.

        Args:
          encoder_params: the variables from :meth:`init_encoder`.

        Returns:
          kernel path -> tuple of follower paths (possibly empty), for every
          path :attr:`prunable_rule` selects.

        Raises:
          ValueError: a follower does not have shape ``[out]``.
        """
        flat = selection.flatten(encoder_params)
        out = {}
        for kernel in selection.select_paths(encoder_params, self.prunable_rule):
            module = kernel[: -len("/kernel")]
            parent, _, name = module.rpartition("/")
            candidates = [f"{module}/bias"]
            if "conv" in name:
                bn = f"{parent}/{name.replace('conv', 'bn')}"
                candidates += [f"{bn}/scale", f"{bn}/bias"]
            followers = tuple(p for p in candidates if p in flat)
            channels = flat[kernel].shape[-1]
            for p in followers:
                if tuple(flat[p].shape) != (channels,):
                    raise ValueError(
                        f"{p} has shape {list(flat[p].shape)}, but {kernel} has "
                        f"{channels} output channels; the naming convention "
                        "conv_* -> bn_* does not hold for this backbone."
                    )
            out[kernel] = followers
        return out


def default_vision_model_config() -> ml_collections.ConfigDict:
    """The ``config.model`` fields :func:`build_vision_model` reads.

    - ``arch``: one of :data:`ARCHS`.
    - ``dtype``: compute dtype, ``"float32"`` or ``"bfloat16"``.
    - ``widths``: conv channels / ResNet stage widths / MLP hidden widths;
      empty: the reference widths (:data:`DEFAULT_WIDTHS`).
    - ``activations``: SimpleConvNet activation per layer; empty: ReLU, ReLU,
      ReLU, Tanh (one per width; with other widths give them explicitly or
      the last is Tanh and the others ReLU).
    - ``kernel_size``: SimpleConvNet kernel side (7).
    - ``stage_sizes``: ResNet blocks per stage ((2, 2, 2, 2)).
    - ``small_stem``: ResNet 3x3 stride-1 stem without max pool (False).
    """
    c = ml_collections.ConfigDict()
    c.arch = "simple_convnet"
    c.dtype = "float32"
    c.widths = ()
    c.activations = ()
    c.kernel_size = 7
    c.stage_sizes = (2, 2, 2, 2)
    c.small_stem = False
    return c


def _backbone(model_cfg: ml_collections.ConfigDict, dtype: Dtype) -> nn.Module:
    arch = model_cfg.arch
    widths = tuple(model_cfg.widths) or DEFAULT_WIDTHS[arch]
    if arch == "simple_convnet":
        acts = tuple(model_cfg.activations) or ("relu",) * (len(widths) - 1) + ("tanh",)
        unknown = sorted(set(acts) - set(ACTIVATIONS))
        if unknown:
            raise ValueError(
                f"config.model.activations has unknown {unknown}; use "
                f"{sorted(ACTIVATIONS)}."
            )
        return SimpleConvNet(
            widths=widths,
            activations=acts,
            kernel_size=model_cfg.kernel_size,
            dtype=dtype,
        )
    if arch == "resnet18":
        return ResNet18(
            widths=widths,
            stage_sizes=tuple(model_cfg.stage_sizes),
            small_stem=model_cfg.small_stem,
            dtype=dtype,
        )
    return MLP(widths=widths, dtype=dtype)


def build_vision_model(
    model_cfg: ml_collections.ConfigDict,
    *,
    num_task_classes: int,
    image_shape: Sequence[int],
    rng: jax.Array,
) -> tuple[VisionModel, dict[str, Any]]:
    """The model and its initial encoder variables.

    Args:
      model_cfg: shaped like :func:`default_vision_model_config`.
      num_task_classes: task classes ``C``.
      image_shape: ``(H, W, C)`` of the inputs (``ImageDataset.image_shape``).
      rng: PRNG key of the encoder init.

    Returns:
      ``(model, {"params": ..., "batch_stats": ...})``.
    """
    if model_cfg.arch not in ARCHS:
        raise ValueError(
            f"config.model.arch={model_cfg.arch!r}; use one of {list(ARCHS)}."
        )
    if model_cfg.dtype not in _DTYPES:
        raise ValueError(
            f"config.model.dtype={model_cfg.dtype!r}; use one of {sorted(_DTYPES)}."
        )
    image_shape = tuple(int(d) for d in image_shape)
    if len(image_shape) != 3:
        raise ValueError(f"image_shape must be (H, W, C), got {image_shape}.")
    backbone = _backbone(model_cfg, _DTYPES[model_cfg.dtype])
    feature_dim = int(backbone.widths[-1])
    model = VisionModel(
        backbone=backbone,
        task_head=torch_dense(num_task_classes, fan_in=feature_dim),
        feature_dim=feature_dim,
        image_shape=image_shape,
        stateful=model_cfg.arch != "mlp",
    )
    return model, model.init_encoder(rng)
