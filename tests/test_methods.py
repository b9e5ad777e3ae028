"""The Method interface: the registry, the shared hooks' checks, optimiser roles."""

import jax
import jax.numpy as jnp
import pytest

from moddiffy_jax import train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.methods import common, interface, registry, standard


def tiny(method):
    return experiment_config(method, "model=tiny")


def test_every_registered_method_is_a_method_value():
    assert len(registry.METHODS) >= 12
    for name, method in registry.METHODS.items():
        assert isinstance(method, interface.Method) and method.name == name
        assert method.driver is not None or method.init is not interface._no_loop


def test_duplicate_method_names_are_refused():
    class Family:
        __name__ = "fake"
        METHODS = (registry.get_method("finetune"),)

    with pytest.raises(ValueError, match="'finetune' is defined twice"):
        registry._collect([Family, Family])


def test_standard_hooks_refuse_an_encoder_label_they_do_not_know():
    ctx = train.build_context(tiny("finetune"))
    odd = interface.Method(
        name="odd",
        encoder="lora",
        debias="none",
        description="",
        init=standard.init,
    )
    ctx.method = odd
    with pytest.raises(ValueError, match="encoder labels"):
        odd.init(ctx, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="non-empty label"):
        interface.Method(name="x", encoder="", debias="none", description="")


def test_an_unmatched_parameter_is_named():
    tree = {"core": {"w": jnp.zeros(2)}, "mystery": {"w": jnp.zeros(2)}}
    with pytest.raises(ValueError, match="mystery/w"):
        common.role_labels(tree)
