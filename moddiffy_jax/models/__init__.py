"""moddiffy_jax.models: Flax BERT with its HF checkpoint loader, and heads."""

from moddiffy_jax.models.bert import (
    BertConfig,
    BertEncoder,
    BottleneckAdapter,
    EncoderOutput,
    convert_hf_state_dict,
    encode,
    init_adapter_params,
    init_params,
    load_pretrained,
    load_tokenizer,
    param_shapes,
    resolve_model_dir,
)
from moddiffy_jax.models.heads import (
    ClassifierHead,
    HeadEnsemble,
    torch_dense,
    torch_linear_bias_init,
    torch_linear_kernel_init,
)

__all__ = [
    "BertConfig",
    "BertEncoder",
    "BottleneckAdapter",
    "ClassifierHead",
    "EncoderOutput",
    "HeadEnsemble",
    "convert_hf_state_dict",
    "encode",
    "init_adapter_params",
    "init_params",
    "load_pretrained",
    "load_tokenizer",
    "param_shapes",
    "resolve_model_dir",
    "torch_dense",
    "torch_linear_bias_init",
    "torch_linear_kernel_init",
]
