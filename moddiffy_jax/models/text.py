"""A BERT text classifier with its heads, as pure functions over param trees.

``TextModel`` bundles the (static) Flax modules; params live outside it:
encoder params (a BERT tree), a task head, and one adversary ensemble per
protected attribute. The representation is the CLS vector of the last layer
(``last_hidden_state[:, 0]``), as in the MoDDiffy reference; the pooler is
unused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from moddiffy_jax.models import bert as bert_lib
from moddiffy_jax.models.heads import ClassifierHead, HeadEnsemble

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ADAPTER_RULE = r"encoder/layer_\d+/adapter/.*"


@dataclasses.dataclass(frozen=True)
class TextModel:
    """Static modules of a text classifier; every method takes params explicitly."""

    bert_config: bert_lib.BertConfig
    encoder: bert_lib.BertEncoder
    task_head: ClassifierHead
    adversaries: Mapping[str, HeadEnsemble]
    adapter_rule: str = ADAPTER_RULE

    @property
    def feature_dim(self) -> int:
        """``H``, the width of the representations."""
        return self.bert_config.hidden_size

    @property
    def gathered_rows(self) -> tuple[str, ...]:
        """Encoder parameters read only by rows (bert_model.GATHERED_ROWS)."""
        return bert_lib.GATHERED_ROWS

    def represent(
        self, params: Any, batch: Mapping[str, Any], rng: jax.Array | None, train: bool
    ) -> jax.Array:
        """CLS representations [B, H] (float32) of a batch of token ids."""
        rngs = {"dropout": rng} if train else None
        out = self.encoder.apply(
            {"params": params},
            batch["input_ids"],
            batch["attention_mask"],
            batch.get("token_type_ids"),
            deterministic=not train,
            rngs=rngs,
            cls_only=True,  # the last layer's other positions: unread work
        )
        return out.last_hidden_state[:, 0].astype(jnp.float32)

    def task_logits(
        self, params: Any, h: jax.Array, rng: jax.Array | None, train: bool
    ) -> jax.Array:
        """Task logits [B, C] from representations [B, H]."""
        rngs = {"dropout": rng} if train else None
        return self.task_head.apply(
            {"params": params}, h, deterministic=not train, rngs=rngs
        ).astype(jnp.float32)

    def adversary_logits(
        self,
        attribute: str,
        params: Any,
        h: jax.Array,
        rng: jax.Array | None,
        train: bool,
    ) -> jax.Array:
        """Logits [K, B, C_attr] of ``attribute``'s adversary ensemble."""
        rngs = {"dropout": rng} if train else None
        return (
            self.adversaries[attribute]
            .apply({"params": params}, h, deterministic=not train, rngs=rngs)
            .astype(jnp.float32)
        )

    def init_task_head(self, rng: jax.Array) -> Any:
        h = jnp.zeros((1, self.bert_config.hidden_size), jnp.float32)
        return dict(self.task_head.init(rng, h)["params"])

    def init_adversary(self, attribute: str, rng: jax.Array) -> Any:
        h = jnp.zeros((1, self.bert_config.hidden_size), jnp.float32)
        return dict(self.adversaries[attribute].init(rng, h)["params"])


def random_bert_config(model_cfg: ml_collections.ConfigDict) -> bert_lib.BertConfig:
    """The random tiny BERT of ``model_cfg`` (``init="random"`` without a
    ``dir``): :meth:`BertConfig.tiny` with its vocabulary and layers (runs
    written before ``num_layers`` existed had BertConfig.tiny's 2)."""
    layers = model_cfg.get("num_layers", 2)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(
            f"config.model.num_layers={layers!r}: the random model needs a "
            "whole number of encoder layers, at least 1."
        )
    return bert_lib.BertConfig.tiny(
        vocab_size=model_cfg.vocab_size, num_hidden_layers=layers
    )


def load_tokenizer_for(model_cfg: ml_collections.ConfigDict):
    """The tokenizer of ``model_cfg.tokenizer_dir`` or else ``model_cfg.dir``.

    A randomly initialised model (``init="random"``) still uses a real
    WordPiece tokenizer, by default the bundled MiniLM one.
    """
    return bert_lib.load_tokenizer(model_cfg.tokenizer_dir or model_cfg.dir or None)


def build_model(
    model_cfg: ml_collections.ConfigDict,
    *,
    num_task_classes: int,
    attr_classes: Mapping[str, int],
    adversary: ml_collections.ConfigDict | None,
    rng: jax.Array,
    with_adapters: bool = False,
) -> tuple[TextModel, Any]:
    """The model and its initial encoder params.

    Args:
      model_cfg: ``config.model``: ``init`` ("pretrained" loads ``dir``, or
        the bundled MiniLM when empty; "random" builds ``BertConfig.tiny`` or
        the architecture of ``dir``'s config.json with random weights),
        ``dtype``, ``scan_layers``, ``attention``, ``attention_dropout``,
        ``task_hidden``, ``task_dropout``,
        ``adapter_reduction_factor``.
      num_task_classes: task classes C.
      attr_classes: classes per protected attribute.
      adversary: ``config.method.adversary`` (members, hidden, dropout), or
        None for a method that trains no adversaries (no removal terms).
      rng: PRNG key for random init and adapters.
      with_adapters: add bottleneck adapters (adapter methods only).

    Returns:
      ``(model, encoder_params)``.
    """
    if model_cfg.dtype not in _DTYPES:
        raise ValueError(
            f"config.model.dtype={model_cfg.dtype!r}; use one of {sorted(_DTYPES)}."
        )
    rf = model_cfg.adapter_reduction_factor if with_adapters else 0
    if model_cfg.init == "pretrained":
        bert_config, params = bert_lib.load_pretrained(
            model_cfg.dir or None, adapter_reduction_factor=rf, rng=rng
        )
    elif model_cfg.init == "random":
        if model_cfg.dir:
            base = bert_lib.BertConfig.from_json(
                bert_lib.resolve_model_dir(model_cfg.dir) / "config.json"
            )
        else:
            base = random_bert_config(model_cfg)
        bert_config = dataclasses.replace(base, adapter_reduction_factor=rf)
        params = bert_lib.init_params(bert_config, rng)
    else:
        raise ValueError(
            f"config.model.init={model_cfg.init!r}; use 'pretrained' or 'random'."
        )
    dtype = _DTYPES[model_cfg.dtype]
    attention = model_cfg.get("attention", "xla")
    attention_dropout = model_cfg.get("attention_dropout", -1.0)
    if attention_dropout >= 0:
        bert_config = dataclasses.replace(
            bert_config, attention_probs_dropout_prob=float(attention_dropout)
        )
    bert_lib.check_attention(attention, bert_config, deterministic=False)
    model = TextModel(
        bert_config=bert_config,
        encoder=bert_lib.BertEncoder(
            bert_config,
            dtype=dtype,
            scan_layers=bool(model_cfg.get("scan_layers")),
            attention=attention,
        ),
        task_head=ClassifierHead(
            num_outputs=num_task_classes,
            num_hidden=model_cfg.task_hidden,
            dropout=model_cfg.task_dropout,
        ),
        adversaries={
            attr: HeadEnsemble(
                num_outputs=n,
                num_members=adversary.members,
                num_hidden=adversary.hidden,
                dropout=adversary.dropout,
            )
            for attr, n in (attr_classes.items() if adversary is not None else ())
        },
    )
    return model, params
