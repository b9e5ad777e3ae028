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


def test_a_config_holds_only_what_its_method_reads():
    for name, method in registry.METHODS.items():
        config = experiment_config(name, None)
        # The diff family (and only it) reads config.diff; only methods that
        # remove an attribute carry the removal recipe and the adversaries.
        assert ("diff" in config) == (name.startswith(("diffprun", "moddiffy")))
        for field in ("objective", "mmd_weight", "fisher_weight", "adversary"):
            assert (field in config.method) == (method.debias != "none"), (name, field)
        assert ("lora" in config) == (name.startswith("lora"))
        assert ("srnets" in config) == (name.startswith("srnets"))
        assert ("ffw" in config) == (name == "ffw")


def test_a_removal_argument_to_a_method_that_removes_nothing_is_named():
    with pytest.raises(ValueError, match="objective=adversarial is a removal"):
        experiment_config("finetune", "objective=adversarial")
    with pytest.raises(AttributeError):
        experiment_config("finetune", None).diff  # noqa: B018
    ctx = train.build_context(tiny("finetune"))
    assert ctx.diff_settings is None and ctx.debias is None
    assert not ctx.model.adversaries
