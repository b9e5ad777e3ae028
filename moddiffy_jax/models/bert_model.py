"""BERT encoder in Flax linen (the checkpoint loader is in bert_files).

The module tree mirrors Hugging Face ``BertModel`` so that flattened parameter
paths read naturally and path rules (regexes) can address them::

    embeddings/word_embeddings/embedding                 [vocab, H]
    embeddings/position_embeddings/embedding             [max_pos, H]
    embeddings/token_type_embeddings/embedding           [type_vocab, H]
    embeddings/LayerNorm/{scale,bias}                    [H]
    encoder/layer_{i}/attention/self/{query,key,value}/kernel   [H, H]
    encoder/layer_{i}/attention/self/{query,key,value}/bias     [H]
    encoder/layer_{i}/attention/output/dense/{kernel,bias}      [H, H], [H]
    encoder/layer_{i}/attention/output/LayerNorm/{scale,bias}   [H]
    encoder/layer_{i}/intermediate/dense/{kernel,bias}          [H, I], [I]
    encoder/layer_{i}/output/dense/{kernel,bias}                [I, H], [H]
    encoder/layer_{i}/output/LayerNorm/{scale,bias}             [H]
    encoder/layer_{i}/adapter/down/{kernel,bias}   (optional)   [H, H/rf], [H/rf]
    encoder/layer_{i}/adapter/up/{kernel,bias}     (optional)   [H/rf, H], [H]
    pooler/dense/{kernel,bias}                                  [H, H], [H]

Kernels are ``(in, out)`` (torch ``nn.Linear`` weights are ``(out, in)`` and
are transposed by the loader).

Calling convention: :func:`init_params` returns the plain params dict (no
``{"params": ...}`` wrapper). To call the module directly use
``BertEncoder(config).apply({"params": params}, input_ids, attention_mask,
deterministic=False, rngs={"dropout": key})``, or use :func:`encode`, which
does the wrapping.

Pretrained weights enter only through :func:`load_pretrained`, which reads a
Hugging Face checkpoint directory (``config.json`` + ``model.safetensors``),
never unpickles, and checks every tensor's name and shape against the
module's own initialisation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from moddiffy_jax.models.adapter import BottleneckAdapter
from moddiffy_jax.models.dropout import Dropout
from moddiffy_jax.models.mixed_dot import dense_dot_general

PyTree = Any
Dtype = Any


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
}


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


# Encoders with this architecture (BERT, and RoBERTa's position rule).
MODEL_TYPES = ("bert", "roberta", "xlm-roberta")

# Attention kernels (BertSelfAttention): the spelled-out default, and
# jax.nn.dot_product_attention through XLA or cuDNN's fused flash attention.
ATTENTIONS = ("xla", "dot_product", "cudnn")


def check_attention(attention: str, config: BertConfig, deterministic: bool) -> None:
    """Refuses an unknown kernel, or a fused one asked for attention dropout."""
    if attention not in ATTENTIONS:
        raise ValueError(
            f"attention={attention!r} is not a kernel; use one of {list(ATTENTIONS)}."
        )
    if attention != "xla" and not deterministic and config.attention_probs_dropout_prob:
        raise ValueError(
            f"attention={attention!r} has no attention-probability dropout, and "
            f"this model's attention_probs_dropout_prob is "
            f"{config.attention_probs_dropout_prob}: set it to 0 "
            "(config.model.attention_dropout=0) or use attention='xla'."
        )


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Hyperparameters of a BERT encoder (names follow Hugging Face).

    Attributes:
      vocab_size: Number of word-piece ids.
      hidden_size: Model width ``H``.
      num_hidden_layers: Number of transformer layers.
      num_attention_heads: Heads per layer; must divide ``hidden_size``.
      intermediate_size: FFN width ``I``.
      hidden_act: FFN activation: ``"gelu"`` (exact erf GELU, as in HF),
        ``"gelu_new"``/``"gelu_pytorch_tanh"`` (tanh approximation) or
        ``"relu"``.
      hidden_dropout_prob: Dropout on embeddings and residual branches.
      attention_probs_dropout_prob: Dropout on attention probabilities.
      max_position_embeddings: Maximum sequence length.
      type_vocab_size: Number of token-type (segment) ids.
      layer_norm_eps: LayerNorm epsilon.
      pad_token_id: Id of the padding token (informational; masking is by
        ``attention_mask``).
      initializer_range: Stddev of the normal init of kernels and embeddings.
      adapter_reduction_factor: If > 0, every layer gets a Pfeiffer bottleneck
        adapter of width ``hidden_size // adapter_reduction_factor``;
        0 means no adapters.
      model_type: ``"bert"``, or ``"roberta"`` / ``"xlm-roberta"`` (the same
        encoder, with positions counted from ``pad_token_id + 1`` over the
        non-padding tokens, as transformers' RobertaEmbeddings does;
        RoBERTa checkpoints have one token type).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    initializer_range: float = 0.02
    adapter_reduction_factor: int = 0
    model_type: str = "bert"

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; supported: "
                f"{list(MODEL_TYPES)}."
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"Unsupported hidden_act {self.hidden_act!r}; supported: "
                f"{sorted(_ACTIVATIONS)}."
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}."
            )
        rf = self.adapter_reduction_factor
        if rf < 0 or (rf > 0 and self.hidden_size // rf < 1):
            raise ValueError(
                f"adapter_reduction_factor={rf} is invalid for hidden_size="
                f"{self.hidden_size} (need 0, or 1 <= rf <= hidden_size)."
            )

    @property
    def padding_positions(self) -> bool:
        """Positions from ``pad_token_id + 1`` over non-padding tokens (RoBERTa)."""
        return self.model_type != "bert"

    @property
    def max_length(self) -> int:
        """The longest sequence the position table covers."""
        if self.padding_positions:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def adapter_size(self) -> int:
        """Bottleneck width of the adapters (0 when there are none)."""
        rf = self.adapter_reduction_factor
        return self.hidden_size // rf if rf else 0

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides: Any) -> BertConfig:
        """Builds a config from a Hugging Face ``config.json`` dict.

        Unknown keys are ignored. A ``position_embedding_type`` other than
        ``"absolute"`` and a ``model_type`` outside :data:`MODEL_TYPES` are refused,
        since this module does not implement them.

        Args:
          d: The parsed ``config.json``.
          **overrides: Field values that take precedence over ``d`` (e.g.
            ``adapter_reduction_factor=16``).

        Returns:
          The config.
        """
        pos_type = d.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(
                f"position_embedding_type={pos_type!r} is not supported "
                "(only 'absolute')."
            )
        model_type = d.get("model_type", "bert")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; supported: "
                f"{list(MODEL_TYPES)}."
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise TypeError(f"Unknown BertConfig fields: {sorted(unknown)}.")
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.update(overrides)
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if required:
            raise ValueError(f"HF config is missing required keys: {required}.")
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> BertConfig:
        """Reads a Hugging Face ``config.json`` file; see :meth:`from_hf_dict`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), **overrides)

    @classmethod
    def tiny(cls, vocab_size: int = 30522, **overrides: Any) -> BertConfig:
        """A tiny config for tests: H=32, 2 layers, 2 heads, I=64, 64 positions."""
        kwargs = dict(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        kwargs.update(overrides)
        return cls(**kwargs)


# --------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------


@flax.struct.dataclass
class EncoderOutput:
    """Output of :class:`BertEncoder`.

    Attributes:
      last_hidden_state: ``[B, L, H]`` final-layer token states (compute dtype).
      pooler_output: ``[B, H]`` ``tanh(dense(last_hidden_state[:, 0]))``.
    """

    last_hidden_state: jax.Array
    pooler_output: jax.Array


def _dense(config: BertConfig, features: int, name: str, dtype, param_dtype):
    return nn.Dense(
        features,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.initializers.normal(config.initializer_range),
        dot_general=dense_dot_general,
        name=name,
    )


def _layer_norm(config: BertConfig, dtype, param_dtype):
    return nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=dtype,
        param_dtype=param_dtype,
        name="LayerNorm",
    )


#: Parameters the encoder reads only by rows (``jnp.take``): a diff may hand
#: them over as a table object with ``take_rows(ids)`` (subnets.dense_diff's
#: GatedRows) instead of an array, so only the rows a batch reads are built.
GATHERED_ROWS = ("embeddings/word_embeddings/embedding",)


class _RowEmbed(nn.Module):
    """``nn.Embed`` (same parameter name and values) that also accepts a
    table object with ``take_rows(ids)`` in place of the array.

    Rows are gathered in the table's own dtype and then cast to ``dtype``
    (``nn.Embed`` casts the table first): the same values, but the backward
    pass then sums a repeated row's gradients (padding, ``[CLS]``, token
    type 0: tens of thousands per batch) in the parameters' float32, not in
    bfloat16. On a GPU that scatter-add took 63 of the 119 ms of a bf16
    BERT-base fine-tuning step (stop 30, docs/speed.md).
    """

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    embedding_init: Any = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, ids):
        if not self.has_variable("params", "embedding"):
            table = self.param(
                "embedding",
                self.embedding_init,
                (self.num_embeddings, self.features),
                self.param_dtype,
            )
        else:  # read as given: no shape check against an initializer
            table = self.get_variable("params", "embedding")
        if hasattr(table, "take_rows"):
            return table.take_rows(ids).astype(self.dtype)
        return jnp.take(jnp.asarray(table), ids, axis=0).astype(self.dtype)


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids, token_type_ids, *, deterministic: bool):
        cfg = self.config
        init = nn.initializers.normal(cfg.initializer_range)

        def embed(num, name):
            return _RowEmbed(
                num,
                cfg.hidden_size,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                embedding_init=init,
                name=name,
            )

        seq_len = input_ids.shape[-1]
        if cfg.padding_positions:
            real = (input_ids != cfg.pad_token_id).astype(jnp.int32)
            positions = jnp.cumsum(real, axis=-1) * real + cfg.pad_token_id
        else:
            positions = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
        x = _RowEmbed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=init,
            name="word_embeddings",
        )(input_ids)
        x = x + embed(cfg.max_position_embeddings, "position_embeddings")(positions)
        x = x + embed(cfg.type_vocab_size, "token_type_embeddings")(token_type_ids)
        x = _layer_norm(cfg, self.dtype, self.param_dtype)(x)
        return Dropout(cfg.hidden_dropout_prob)(x, deterministic=deterministic)


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention (query/key/value projections).

    ``attention`` picks the kernel (see :data:`ATTENTIONS`): ``"xla"`` spells
    out scores, a float32 softmax and attention-probability dropout, as
    Hugging Face does; ``"dot_product"`` and ``"cudnn"`` call
    ``jax.nn.dot_product_attention`` (``"cudnn"``: fused flash attention on an
    NVIDIA GPU, bf16 or fp16), which never materialises the ``[B, heads, L,
    L]`` scores and has no attention-probability dropout, so with dropout on
    they need ``attention_probs_dropout_prob == 0``.
    """

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"

    def _fused(self, q, k, v, mask_bias, deterministic):
        check_attention(self.attention, self.config, deterministic)
        # The key mask as booleans [B, 1, Lq, L]: cuDNN wants full query and
        # key axes, and turns it into its own safe large negative bias.
        keep = jnp.broadcast_to(mask_bias == 0, (q.shape[0], 1, q.shape[1], k.shape[1]))
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=keep,
            implementation="cudnn" if self.attention == "cudnn" else None,
        )

    @nn.compact
    def __call__(self, x, mask_bias, *, deterministic: bool, queries=None):
        """Attends ``x`` [B, L, H] to itself (its first ``queries`` positions
        only, where given); ``mask_bias`` is [B, 1, 1, L] f32."""
        cfg = self.config
        heads, head_dim = cfg.num_attention_heads, cfg.head_dim

        def project(name, rows):
            y = _dense(cfg, cfg.hidden_size, name, self.dtype, self.param_dtype)(rows)
            return y.reshape(*rows.shape[:2], heads, head_dim)

        q = project("query", _first(x, queries))
        k, v = project("key", x), project("value", x)
        batch, length = q.shape[:2]
        if self.attention != "xla":
            return self._fused(q, k, v, mask_bias, deterministic).reshape(
                batch, length, cfg.hidden_size
            )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(
            q.dtype
        )
        # Softmax in float32 whatever the compute dtype; the bias is float32 so a
        # large negative never overflows a bfloat16 range.
        probs = jax.nn.softmax(scores.astype(jnp.float32) + mask_bias, axis=-1)
        probs = Dropout(cfg.attention_probs_dropout_prob)(
            probs.astype(self.dtype),
            deterministic=deterministic,
            **_full(2, x, queries),
        )
        context = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return context.reshape(batch, length, cfg.hidden_size)


def _first(x, queries):  # x [B, L, ...] cut to its first queries positions
    return x if queries is None else x[:, :queries]


def _full(axis, x, queries):  # Dropout's full= for outputs cut to queries
    return {} if queries is None else {"full": (axis, x.shape[1])}


class _DenseDropoutLayerNorm(nn.Module):
    """``LayerNorm(residual + adapter(dropout(dense(x))))`` (HF's *Output blocks)."""

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, residual, *, deterministic: bool, adapter=None, full=None):
        cfg, full = self.config, full or {}
        h = _dense(cfg, cfg.hidden_size, "dense", self.dtype, self.param_dtype)(x)
        h = Dropout(cfg.hidden_dropout_prob)(h, deterministic=deterministic, **full)
        if adapter is not None:
            h = adapter(h)
        return _layer_norm(cfg, self.dtype, self.param_dtype)(h + residual)


class _DenseActivation(nn.Module):
    """``activation(dense(x))`` (HF's intermediate and pooler blocks)."""

    config: BertConfig
    features: int
    activation: Callable[[jax.Array], jax.Array]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = _dense(
            self.config, self.features, "dense", self.dtype, self.param_dtype
        )
        return self.activation(dense(x))


class BertAttention(nn.Module):
    """Self-attention plus its output projection, residual and LayerNorm."""

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"

    @nn.compact
    def __call__(self, x, mask_bias, *, deterministic: bool, queries=None):
        kw = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
        context = BertSelfAttention(**kw, attention=self.attention, name="self")(
            x, mask_bias, deterministic=deterministic, queries=queries
        )
        return _DenseDropoutLayerNorm(**kw, name="output")(
            context,
            _first(x, queries),
            deterministic=deterministic,
            full=_full(1, x, queries),
        )


class BertLayer(nn.Module):
    """One post-LN transformer layer (attention, FFN, optional adapter)."""

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"

    @nn.compact
    def __call__(self, x, mask_bias, *, deterministic: bool, queries=None):
        """``x`` [B, L, H] -> [B, L, H] (with ``queries``: [B, queries, H])."""
        cfg = self.config
        kw = dict(config=cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        full = _full(1, x, queries)
        x = BertAttention(**kw, attention=self.attention, name="attention")(
            x, mask_bias, deterministic=deterministic, queries=queries
        )
        h = _DenseActivation(
            **kw,
            features=cfg.intermediate_size,
            activation=_ACTIVATIONS[cfg.hidden_act],
            name="intermediate",
        )(x)
        adapter = None
        if cfg.adapter_reduction_factor:
            adapter = BottleneckAdapter(
                hidden_size=cfg.hidden_size,
                bottleneck_size=cfg.adapter_size,
                initializer_range=cfg.initializer_range,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="adapter",
            )
        return _DenseDropoutLayerNorm(**kw, name="output")(
            h, x, deterministic=deterministic, adapter=adapter, full=full
        )


class BertStack(nn.Module):
    """``num_hidden_layers`` :class:`BertLayer` s named ``layer_{i}``.

    With ``scan``, applying the stack runs one layer body under
    ``jax.lax.scan`` over the layers' params stacked on a leading axis, so
    XLA compiles the layer (and its backward pass) once instead of once per
    layer; the param tree keeps its ``layer_{i}`` names (init, checkpoints,
    diffs and Hugging Face files are unchanged). The values are those of the
    unrolled stack; with dropout on, each layer's dropout key is drawn from
    one ``"dropout"`` key of the stack, so the masks differ from the unrolled
    stack's (same distribution).
    """

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    scan: bool = False
    attention: str = "xla"

    @nn.compact
    def __call__(self, x, mask_bias, *, deterministic: bool, last_queries=None):
        """``last_queries``: the last layer's outputs at that many positions."""
        n = self.config.num_hidden_layers
        kw = dict(
            config=self.config,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
        )
        if not self.scan or n < 2 or self.is_initializing():
            for i in range(n):
                x = BertLayer(**kw, name=f"layer_{i}")(
                    x,
                    mask_bias,
                    deterministic=deterministic,
                    queries=last_queries if i == n - 1 else None,
                )
            return x
        params = self.variables.get("params", {})
        names = [f"layer_{i}" for i in range(n)]
        missing = [name for name in names if name not in params]
        if missing:
            raise ValueError(
                f"The encoder params have no {missing[0]} (expected layer_0 .. "
                f"layer_{n - 1} under 'encoder'): load params that match "
                "this BertConfig's num_hidden_layers."
            )
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[k] for k in names))
        layer = BertLayer(**kw, parent=None)
        keys = None if deterministic else jax.random.split(self.make_rng("dropout"), n)

        def body(h, per_layer):
            p, key = per_layer
            rngs = None if key is None else {"dropout": key}
            h = layer.apply(
                {"params": p}, h, mask_bias, deterministic=deterministic, rngs=rngs
            )
            return h, None

        if last_queries is None:
            x, _ = jax.lax.scan(body, x, (stacked, keys))
            return x
        rest = jax.tree.map(lambda a: a[:-1], (stacked, keys))
        x, _ = jax.lax.scan(body, x, rest)
        rngs = None if keys is None else {"dropout": keys[-1]}
        p = {"params": jax.tree.map(lambda a: a[-1], stacked)}
        kw = dict(deterministic=deterministic, queries=last_queries, rngs=rngs)
        return layer.apply(p, x, mask_bias, **kw)


class BertEncoder(nn.Module):
    """Post-LN BERT encoder with pooler, parameter tree named as in HF.

    Attributes:
      config: The :class:`BertConfig`.
      dtype: Compute dtype (``jnp.float32`` or ``jnp.bfloat16``). Attention
        softmax is always computed in float32.
      param_dtype: Parameter dtype.
      scan_layers: Run the layers under ``jax.lax.scan`` (:class:`BertStack`):
        one compiled layer body instead of ``num_hidden_layers``.
      attention: The attention kernel, one of :data:`ATTENTIONS` (see
        :class:`BertSelfAttention`); the values agree to rounding.
    """

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    scan_layers: bool = False
    attention: str = "xla"

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        *,
        deterministic: bool = True,
        cls_only: bool = False,
    ) -> EncoderOutput:
        """Encodes a batch of token ids.

        Args:
          input_ids: ``[B, L]`` int token ids.
          attention_mask: ``[B, L]`` 1 (or True) for real tokens, 0 for padding.
          token_type_ids: ``[B, L]`` segment ids; zeros if None.
          deterministic: If False, dropout is applied and the ``"dropout"`` rng
            must be provided to ``apply``.
          cls_only: The last layer computes the first position's output
            alone (``last_hidden_state`` [B, 1, H]; [CLS] and the pooler as
            the whole pass gives them, to rounding, with the same dropout).

        Returns:
          :class:`EncoderOutput` with ``last_hidden_state`` [B, L, H] and
          ``pooler_output`` [B, H], both in the compute dtype.
        """
        cfg = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, L], got {input_ids.shape}.")
        if input_ids.shape[1] > cfg.max_length:
            raise ValueError(
                f"Sequence length {input_ids.shape[1]} exceeds the "
                f"{cfg.max_length} positions of max_position_embeddings="
                f"{cfg.max_position_embeddings} ({cfg.model_type})."
            )
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {attention_mask.shape} != input_ids shape "
                f"{input_ids.shape}."
            )
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        kw = dict(config=cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        x = BertEmbeddings(**kw, name="embeddings")(
            input_ids, token_type_ids, deterministic=deterministic
        )
        # Additive key mask [B, 1, 1, L], float32 (added to float32 scores).
        keep = attention_mask.astype(jnp.bool_)[:, None, None, :]
        mask_bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        stack = BertStack(
            **kw, scan=self.scan_layers, attention=self.attention, name="encoder"
        )
        last = 1 if cls_only else None  # the last layer's [CLS] output alone
        x = stack(x, mask_bias, deterministic=deterministic, last_queries=last)
        pooled = _DenseActivation(
            **kw, features=cfg.hidden_size, activation=jnp.tanh, name="pooler"
        )(x[:, 0])
        return EncoderOutput(last_hidden_state=x, pooler_output=pooled)


# --------------------------------------------------------------------------
# Functional helpers
# --------------------------------------------------------------------------


def _dummy_inputs(config: BertConfig):
    length = min(8, config.max_position_embeddings)
    ids = jnp.zeros((1, length), jnp.int32)
    return ids, jnp.ones_like(ids), jnp.zeros_like(ids)


def init_params(config: BertConfig, rng: jax.Array) -> dict[str, Any]:
    """Randomly initialises a :class:`BertEncoder`.

    Args:
      config: The model config.
      rng: A PRNG key.

    Returns:
      The plain params dict (no ``{"params": ...}`` wrapper); wrap it as
      ``{"params": params}`` when calling ``BertEncoder(config).apply``.
    """
    variables = _jitted_init(config)(rng, *_dummy_inputs(config))
    return dict(variables["params"])


@functools.lru_cache(maxsize=16)
def _jitted_init(config: BertConfig):
    """One jitted ``init`` per (frozen, hashable) config in a process: a
    model built again reuses it (0.5 s a build on the tests' tiny BERT)."""
    return jax.jit(BertEncoder(config).init)


def init_adapter_params(config: BertConfig, rng: jax.Array) -> dict[str, Any]:
    """Freshly initialised adapters only (identity maps: ``up`` is zero).

    Args:
      config: A config with ``adapter_reduction_factor > 0``.
      rng: A PRNG key; layer ``i`` uses ``fold_in(rng, i)``.

    Returns:
      ``{"layer_{i}": {"adapter": {"down": ..., "up": ...}}}``, to be merged
      into ``params["encoder"]`` layer by layer.
    """
    if not config.adapter_reduction_factor:
        raise ValueError("config has no adapters (adapter_reduction_factor=0).")
    adapter = BottleneckAdapter(
        hidden_size=config.hidden_size,
        bottleneck_size=config.adapter_size,
        initializer_range=config.initializer_range,
    )
    init = jax.jit(adapter.init)
    dummy = jnp.zeros((1, config.hidden_size), jnp.float32)
    return {
        f"layer_{i}": {"adapter": init(jax.random.fold_in(rng, i), dummy)["params"]}
        for i in range(config.num_hidden_layers)
    }


def param_shapes(config: BertConfig) -> dict[str, Any]:
    """Abstract params (``jax.ShapeDtypeStruct`` leaves) without allocating."""
    module = BertEncoder(config)
    variables = jax.eval_shape(module.init, jax.random.key(0), *_dummy_inputs(config))
    return dict(variables["params"])


def encode(
    config: BertConfig,
    params: PyTree,
    batch_or_arrays: Mapping[str, jax.Array] | Sequence[jax.Array],
    *,
    deterministic: bool = True,
    rngs: jax.Array | Mapping[str, jax.Array] | None = None,
    dtype: Dtype = jnp.float32,
) -> EncoderOutput:
    """Runs :class:`BertEncoder` on a batch.

    Args:
      config: The model config.
      params: The plain params dict (as from :func:`init_params` or
        :func:`load_pretrained`).
      batch_or_arrays: Either a mapping with ``"input_ids"``,
        ``"attention_mask"`` and optionally ``"token_type_ids"`` (other keys
        are ignored), or a tuple ``(input_ids, attention_mask[,
        token_type_ids])``; each array ``[B, L]``.
      deterministic: If False, dropout is on and ``rngs`` is required.
      rngs: A PRNG key (used as the ``"dropout"`` rng) or a dict of rngs.
      dtype: Compute dtype.

    Returns:
      :class:`EncoderOutput` (``last_hidden_state`` [B, L, H],
      ``pooler_output`` [B, H]).
    """
    if isinstance(batch_or_arrays, Mapping):
        arrays = (
            batch_or_arrays["input_ids"],
            batch_or_arrays["attention_mask"],
            batch_or_arrays.get("token_type_ids"),
        )
    else:
        arrays = tuple(batch_or_arrays)
        if len(arrays) not in (2, 3):
            raise ValueError(
                "Expected (input_ids, attention_mask[, token_type_ids]), got "
                f"{len(arrays)} arrays."
            )
    if not deterministic and rngs is None:
        raise ValueError("deterministic=False needs rngs (a 'dropout' key).")
    if rngs is not None and not isinstance(rngs, Mapping):
        rngs = {"dropout": rngs}
    return BertEncoder(config, dtype=dtype).apply(
        {"params": params}, *arrays, deterministic=deterministic, rngs=rngs
    )
