from __future__ import annotations

import dataclasses
import doctest

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import substrax.mesh._rules
from substrax.mesh import (
    MeshRules,
    create_device_mesh,
    create_named_sharding,
    data_parallel_rules,
    fsdp_rules,
    partition_spec_for_names,
)


@pytest.fixture(scope="module")
def mesh42() -> jax.sharding.Mesh:
    return create_device_mesh({"data": 4, "model": 2})


def test_rules_look_up_axes_in_order_none_where_unmapped() -> None:
    rules = MeshRules(data="data", mlp=("model", "data"))
    assert rules("mlp", "data", "heads") == (("model", "data"), "data", None)
    assert rules() == ()
    assert MeshRules()("data", "embed", "mlp", "heads") == (None,) * 4


def test_rules_are_frozen_keyword_only_and_hashable() -> None:
    rules = MeshRules(data="data")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rules.data = "model"  # type: ignore[misc]
    with pytest.raises(TypeError):
        MeshRules("data")  # type: ignore[misc]
    assert hash(rules) == hash(MeshRules(data="data"))
    assert dataclasses.replace(fsdp_rules(), embed=None)("embed", "mlp") == (None, "model")


def test_factories_follow_upstream() -> None:
    assert data_parallel_rules() == MeshRules(data="data")
    assert data_parallel_rules(data_axis="batch") == MeshRules(data="batch")
    assert fsdp_rules() == MeshRules(data="data", embed="model", mlp="model", heads="model")
    assert fsdp_rules(data_axis="dp", model_axis="tp")("data", "embed", "mlp", "heads") == (
        "dp",
        "tp",
        "tp",
        "tp",
    )


def test_partition_spec_for_names() -> None:
    assert partition_spec_for_names(fsdp_rules(), "data", "embed") == PartitionSpec("data", "model")
    assert partition_spec_for_names(data_parallel_rules(), "data", "mlp") == PartitionSpec("data", None)
    assert partition_spec_for_names(fsdp_rules()) == PartitionSpec()


def test_create_named_sharding_places_an_array(mesh42: jax.sharding.Mesh) -> None:
    sharding = create_named_sharding(mesh42, *partition_spec_for_names(fsdp_rules(), "data", "mlp"))
    assert sharding == NamedSharding(mesh42, PartitionSpec("data", "model"))
    x = jax.device_put(np.arange(64.0).reshape(8, 8), sharding)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 4)}
    np.testing.assert_array_equal(np.asarray(x), np.arange(64.0).reshape(8, 8))
    assert create_named_sharding(mesh42).is_fully_replicated
    assert create_named_sharding(mesh42, ("data", "model")).shard_shape((16,)) == (2,)


@pytest.mark.parametrize("value", [3, ["model"], ("model", 1), b"model"])
def test_rule_field_of_wrong_type(value: object) -> None:
    with pytest.raises(
        TypeError, match=r"MeshRules\.mlp must be a mesh axis name \(str\), a tuple of names, or None; got"
    ):
        MeshRules(mlp=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["", (), ("model", "model"), ("model", "")])
def test_rule_field_of_wrong_value(value: object) -> None:
    with pytest.raises(ValueError, match=r"MeshRules\.heads must be a non-empty mesh axis name.* Use None"):
        MeshRules(heads=value)  # type: ignore[arg-type]


def test_unknown_logical_name_names_it_and_the_fields() -> None:
    with pytest.raises(
        ValueError,
        match=r"Unknown logical dimension name 'batch'; MeshRules knows \('data', 'embed', 'mlp', 'heads'\)",
    ):
        fsdp_rules()("data", "batch")
    with pytest.raises(ValueError, match="'__class__'"):
        fsdp_rules()("__class__")
    with pytest.raises(TypeError, match=r"Logical dimension names are str; got None \(NoneType\)"):
        fsdp_rules()("data", None)  # type: ignore[arg-type]


def test_factory_arguments_are_checked_by_name() -> None:
    with pytest.raises(
        TypeError, match=r"data_parallel_rules: data_axis must be a mesh axis name .* got 0 \(int\)"
    ):
        data_parallel_rules(0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"data_parallel_rules: data_axis must be a non-empty"):
        data_parallel_rules("")
    with pytest.raises(TypeError, match=r"fsdp_rules: model_axis must be a mesh axis name"):
        fsdp_rules(model_axis=["model"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fsdp_rules: data_axis must be a non-empty"):
        fsdp_rules(data_axis=())


def test_partition_spec_for_names_errors() -> None:
    with pytest.raises(TypeError, match=r"rules must be a MeshRules .*; got dict"):
        partition_spec_for_names({"data": "data"}, "data")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Unknown logical dimension name 'hidden'"):
        partition_spec_for_names(fsdp_rules(), "hidden")
    with pytest.raises(ValueError, match=r"'embed' and 'mlp' both map to mesh axis 'model'"):
        partition_spec_for_names(fsdp_rules(), "embed", "mlp")
    with pytest.raises(ValueError, match=r"'data' and 'mlp' both map to mesh axis 'data'"):
        partition_spec_for_names(MeshRules(data="data", mlp=("model", "data")), "data", "mlp")


def test_create_named_sharding_errors(mesh42: jax.sharding.Mesh) -> None:
    with pytest.raises(
        TypeError, match=r"create_named_sharding: mesh must be a jax.sharding.Mesh; got tuple"
    ):
        create_named_sharding(("data", "model"), "data")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"create_named_sharding: axis_names\[1\] must be a mesh axis name"):
        create_named_sharding(mesh42, "data", 1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"axis_names\[0\] 'batch' is not in the mesh, whose axes are \('data', 'model'\)"
    ):
        create_named_sharding(mesh42, "batch")
    with pytest.raises(
        ValueError, match=r"axis_names\[0\] and axis_names\[2\] both map to mesh axis 'model'"
    ):
        create_named_sharding(mesh42, ("data", "model"), None, "model")


def test_the_module_docstring_example_runs() -> None:
    # substrax.mesh._rules is private, so tests/test_docs.py collects the examples of the names
    # substrax.mesh re-exports but not this module's own docstring; run them all here.
    failures, tried = doctest.testmod(substrax.mesh._rules, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert tried >= 6 and failures == 0
