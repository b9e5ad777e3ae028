"""BERT in Flax linen, and its Hugging Face checkpoint loader: one namespace.

The model (:class:`BertConfig`, :class:`BertEncoder`, :func:`encode`,
initialisers) is in :mod:`moddiffy_jax.models.bert_model`; finding,
converting and loading checkpoint directories (:func:`load_pretrained`,
:func:`load_tokenizer`, :func:`resolve_model_dir`) in
:mod:`moddiffy_jax.models.bert_files`. Both are reachable here::

    from moddiffy_jax.models import bert
    config, params = bert.load_pretrained()  # the bundled all-MiniLM-L6-v2
"""

from moddiffy_jax.models.bert_files import (
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_MODEL_PIP,
    MODEL_DIR_ENV,
    SAFETENSORS_FILE,
    _flatten,
    _unflatten,
    convert_hf_state_dict,
    load_pretrained,
    load_tokenizer,
    resolve_model_dir,
)
from moddiffy_jax.models.bert_model import (
    ATTENTIONS,
    GATHERED_ROWS,
    BertAttention,
    BertConfig,
    BertEmbeddings,
    BertEncoder,
    BertLayer,
    BertSelfAttention,
    BertStack,
    BottleneckAdapter,
    Dtype,
    EncoderOutput,
    check_attention,
    encode,
    init_adapter_params,
    init_params,
    param_shapes,
)

__all__ = [
    "ATTENTIONS",
    "GATHERED_ROWS",
    "BertAttention",
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "BertLayer",
    "BertSelfAttention",
    "BertStack",
    "BottleneckAdapter",
    "DEFAULT_MODEL_PACKAGE",
    "DEFAULT_MODEL_PIP",
    "Dtype",
    "EncoderOutput",
    "MODEL_DIR_ENV",
    "SAFETENSORS_FILE",
    "_flatten",
    "_unflatten",
    "check_attention",
    "convert_hf_state_dict",
    "encode",
    "init_adapter_params",
    "init_params",
    "load_pretrained",
    "load_tokenizer",
    "param_shapes",
    "resolve_model_dir",
]
