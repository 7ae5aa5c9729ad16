"""substrax.mesh.strategies: the specs each strategy gives, placement, pipeline stages, the merge
(the sharding configs: ``test_strategy_configs.py``)."""

from __future__ import annotations

import dataclasses
import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import substrax.mesh
import substrax.mesh.strategies
from substrax.mesh import (
    DataParallelStrategy,
    FSDPStrategy,
    MultiDimensionalStrategy,
    ParallelismConfig,
    PipelineParallelStrategy,
    ShardingConfig,
    ShardingStrategy,
    TensorParallelStrategy,
    create_device_mesh,
)

STRATEGIES = [
    DataParallelStrategy(),
    FSDPStrategy(),
    TensorParallelStrategy(),
    PipelineParallelStrategy(num_stages=2),
]


@pytest.fixture(scope="module")
def mesh42() -> jax.sharding.Mesh:
    return create_device_mesh({"data": 4, "model": 2})


def config42() -> ParallelismConfig:
    return ParallelismConfig.from_sharding_config(
        ShardingConfig(data_parallel_size=4, tensor_parallel_size=2)
    )


def test_both_module_paths_export_the_same_names() -> None:
    for name in substrax.mesh.strategies.__all__:
        assert getattr(substrax.mesh, name) is getattr(substrax.mesh.strategies, name)
        assert name in substrax.mesh.__all__


# The strategies' specs


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_every_strategy_follows_the_protocol_and_is_frozen(strategy: object) -> None:
    assert isinstance(strategy, ShardingStrategy)
    assert strategy.partition_spec(()) == P()
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.axis_name = "other"  # type: ignore[attr-defined]
    assert not isinstance(object(), ShardingStrategy)


@pytest.mark.parametrize(
    ("strategy", "names", "spec"),
    [
        (DataParallelStrategy(), ("batch", "sequence", "hidden"), P("data", None, None)),
        (DataParallelStrategy(axis_name="dp", batch_dimension="rows"), ["x", "rows"], P(None, "dp")),
        (DataParallelStrategy(), ("out_features", "in_features"), P(None, None)),
        (FSDPStrategy(axis_name="fsdp"), ("out_features", "in_features"), P("fsdp", None)),
        (FSDPStrategy(), ("hidden",), P("data")),
        (FSDPStrategy(), ("batch", "hidden"), P(None, None)),  # only the leading dimension
        (FSDPStrategy(sharded_dimensions=["embed"]), ("embed", "mlp"), P("data", None)),
        (TensorParallelStrategy(), ("batch", "hidden"), P(None, "model")),
        (TensorParallelStrategy(), ("out_features", "in_features"), P("model", None)),
        (TensorParallelStrategy(), ("hidden", "out_features"), P("model", None)),  # hidden first
        (
            TensorParallelStrategy(shard_dimension="in_features"),
            ("out_features", "in_features"),
            P(None, "model"),
        ),
        (
            TensorParallelStrategy(shard_dimension="heads"),
            ("batch", "heads", "head_dim"),
            P(None, "model", None),
        ),
        (PipelineParallelStrategy(num_stages=4), ("batch", "hidden"), P(None, None)),
    ],
)
def test_partition_specs(strategy: ShardingStrategy, names: tuple, spec: P) -> None:
    assert strategy.partition_spec(names) == spec


def test_tensor_parallel_layer_specs() -> None:
    column, row = TensorParallelStrategy(), TensorParallelStrategy(shard_dimension="in_features")
    assert column.linear_weight_spec == P("model", None)
    assert row.linear_weight_spec == P(None, "model")
    for strategy in (column, row):
        assert strategy.attention_qkv_spec == P(None, "model")
        assert strategy.attention_output_spec == P("model", None)


def test_fsdp_should_shard_by_the_leading_dimension() -> None:
    strategy = FSDPStrategy(min_weight_size=512)
    assert strategy.should_shard(jnp.ones((512, 8))) is True
    assert strategy.should_shard(np.ones((511, 4096))) is False
    assert strategy.should_shard(jnp.float32(3.0)) is False
    assert strategy.sharded_dimensions == frozenset({"out_features", "features", "hidden"})


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: DataParallelStrategy(axis_name=None),
            TypeError,
            r"DataParallelStrategy.axis_name must be a str; got None",
        ),
        (
            lambda: DataParallelStrategy(batch_dimension=""),
            ValueError,
            r"batch_dimension must be a non-empty str",
        ),
        (
            lambda: FSDPStrategy(min_weight_size=0),
            ValueError,
            r"FSDPStrategy.min_weight_size must be at least 1",
        ),
        (
            lambda: FSDPStrategy(sharded_dimensions="hidden"),
            TypeError,
            r"sharded_dimensions must be a set of str; got 'hidden'",
        ),
        (
            lambda: FSDPStrategy(sharded_dimensions={1}),
            TypeError,
            r"sharded_dimensions entries must be a str; got 1",
        ),
        (
            lambda: TensorParallelStrategy(axis_name=""),
            ValueError,
            r"TensorParallelStrategy.axis_name must be a non-empty",
        ),
        (
            lambda: TensorParallelStrategy(shard_dimension=0),
            TypeError,
            r"shard_dimension must be a str; got 0",
        ),
        (lambda: PipelineParallelStrategy(), TypeError, r"num_stages"),
        (lambda: PipelineParallelStrategy(num_stages=0), ValueError, r"num_stages must be at least 1; got 0"),
    ],
)
def test_strategy_field_errors(make, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize(
    ("names", "match"),
    [
        ("batch", r"dimension_names must be a tuple of str, one per dimension.*got 'batch' \(str\)"),
        (("batch", 3), r"dimension names are str; got 3 in \('batch', 3\)"),
    ],
)
def test_dimension_names_errors(strategy: ShardingStrategy, names: object, match: str) -> None:
    with pytest.raises(TypeError, match=type(strategy).__name__ + r".partition_spec: " + match):
        strategy.partition_spec(names)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("strategy", "names", "match"),
    [
        (
            DataParallelStrategy(),
            ("batch", "batch"),
            (
                r"DataParallelStrategy.partition_spec: \('batch', 'batch'\) "
                r"names 'batch' 2 times, but mesh axis 'data' can split only one dimension"
            ),
        ),
        (TensorParallelStrategy(), ("hidden", "hidden"), r"names 'hidden' 2 times, but mesh axis 'model'"),
    ],
)
def test_a_dimension_named_twice_is_refused(strategy: ShardingStrategy, names: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        strategy.partition_spec(names)


# Placement


def _spec(array: jax.Array) -> P:
    return array.sharding.spec


@pytest.mark.parametrize(
    ("strategy", "shape", "spec", "shard_shape"),
    [
        (DataParallelStrategy(), (8, 3), P("data", None), (2, 3)),
        (DataParallelStrategy(), (4,), P("data"), (1,)),
        (FSDPStrategy(min_weight_size=8), (8, 3), P("data", None), (2, 3)),
        (FSDPStrategy(min_weight_size=8), (4, 3), P(None, None), (4, 3)),  # below the threshold
        (FSDPStrategy(min_weight_size=8), (10, 3), P(None, None), (10, 3)),  # 10 does not divide by 4
        (FSDPStrategy(), (), P(), ()),
        (TensorParallelStrategy(), (4, 6), P("model", None), (2, 6)),
        (TensorParallelStrategy(shard_dimension="in_features"), (4, 6), P(None, "model"), (4, 3)),
        (TensorParallelStrategy(), (2, 3, 4), P(None, None, "model"), (2, 3, 2)),
        (TensorParallelStrategy(), (6,), P("model"), (3,)),
        (PipelineParallelStrategy(num_stages=2), (4, 3), P(None, None), (4, 3)),
    ],
)
def test_shard_places_the_array(mesh42, strategy, shape: tuple, spec: P, shard_shape: tuple) -> None:
    host = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    placed = strategy.shard(host, mesh42)
    assert _spec(placed) == spec
    assert placed.sharding.shard_shape(shape) == shard_shape
    np.testing.assert_array_equal(np.asarray(placed), host)


@pytest.mark.parametrize(
    ("strategy", "shape", "error", "match"),
    [
        (
            DataParallelStrategy(),
            (),
            ValueError,
            r"DataParallelStrategy.shard: a 0-d array has no batch dimension",
        ),
        (
            TensorParallelStrategy(),
            (),
            ValueError,
            r"TensorParallelStrategy.shard: a 0-d array has no feature",
        ),
        (
            DataParallelStrategy(),
            (6, 2),
            ValueError,
            (
                r"DataParallelStrategy.shard: dimension 0 of an array of "
                r"shape \(6, 2\) has size 6, which does not divide by 4, the size of mesh axis 'data'"
            ),
        ),
        (
            TensorParallelStrategy(),
            (3, 4),
            ValueError,
            r"dimension 0 .* does not divide by 2, .* axis 'model'",
        ),
        (
            DataParallelStrategy(axis_name="batch"),
            (8,),
            ValueError,
            (
                r"DataParallelStrategy.shard: mesh axis "
                r"'batch' is not in the mesh, whose axes are \('data', 'model'\)"
            ),
        ),
        (FSDPStrategy(axis_name="fsdp", min_weight_size=1), (8,), ValueError, r"mesh axis 'fsdp' is not in"),
    ],
)
def test_shard_errors(mesh42, strategy, shape: tuple, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        strategy.shard(np.zeros(shape, np.float32), mesh42)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_shard_takes_a_mesh(strategy: ShardingStrategy) -> None:
    with pytest.raises(
        TypeError, match=type(strategy).__name__ + r".shard: mesh must be a jax.sharding.Mesh; got dict"
    ):
        strategy.shard(np.zeros((8, 2), np.float32), {"data": 8})  # type: ignore[arg-type]


# Pipeline stages


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("layers", [1, 2, 5, 12, 13, 64])
def test_layers_are_assigned_evenly_earlier_stages_first(layers: int, stages: int) -> None:
    assignment = PipelineParallelStrategy(num_stages=stages).assign_layers(layers)
    assert len(assignment) == stages and sum(assignment) == layers
    assert all(isinstance(n, int) for n in assignment)
    assert list(assignment) == sorted(assignment, reverse=True)
    assert max(assignment) - min(assignment) <= 1


def test_assign_layers_errors() -> None:
    strategy = PipelineParallelStrategy(num_stages=2)
    with pytest.raises(ValueError, match=r"assign_layers: num_layers must be at least 1; got 0"):
        strategy.assign_layers(0)
    with pytest.raises(TypeError, match=r"assign_layers: num_layers must be an int; got 2.5"):
        strategy.assign_layers(2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("stages", "forward"), [(1, ()), (2, ((0, 1),)), (4, ((0, 1), (1, 2), (2, 3)))])
def test_communication_patterns_chain_the_stages(stages: int, forward: tuple) -> None:
    strategy = PipelineParallelStrategy(num_stages=stages)
    assert strategy.forward_communication_pattern == forward
    assert strategy.backward_communication_pattern == tuple((b, a) for a, b in forward)


# MultiDimensionalStrategy


def combine(**strategies: ShardingStrategy) -> MultiDimensionalStrategy:
    return MultiDimensionalStrategy(strategies=strategies, config=config42())


@pytest.mark.parametrize(
    ("strategies", "names", "spec"),
    [
        (
            {"dp": DataParallelStrategy(), "tp": TensorParallelStrategy(shard_dimension="in_features")},
            ("batch", "in_features"),
            P("data", "model"),
        ),
        (
            {"dp": DataParallelStrategy(), "tp": TensorParallelStrategy()},
            ("batch", "seq", "hidden"),
            P("data", None, "model"),
        ),
        # both claim out_features: tensor parallel wins over FSDP, whichever comes first
        (
            {"fsdp": FSDPStrategy(), "tp": TensorParallelStrategy()},
            ("out_features", "in_features"),
            P("model", None),
        ),
        (
            {"tp": TensorParallelStrategy(), "fsdp": FSDPStrategy()},
            ("out_features", "in_features"),
            P("model", None),
        ),
        # FSDP over the data axis beside data parallelism, on a weight and on activations
        ({"dp": DataParallelStrategy(), "fsdp": FSDPStrategy()}, ("hidden", "in_features"), P("data", None)),
        ({"dp": DataParallelStrategy(), "fsdp": FSDPStrategy()}, ("batch", "hidden"), P("data", None)),
        (
            {"dp": DataParallelStrategy(), "pp": PipelineParallelStrategy(num_stages=2)},
            ("batch", "hidden"),
            P("data", None),
        ),
        ({}, ("batch", "hidden"), P(None, None)),
    ],
)
def test_specs_are_merged(strategies: dict, names: tuple, spec: P) -> None:
    assert combine(**strategies).partition_spec(names) == spec


def test_fsdp_wins_over_data_parallel_first_claim_among_others() -> None:
    combined = combine(dp=DataParallelStrategy(axis_name="a"), fsdp=FSDPStrategy(axis_name="b"))
    assert combined.resolve_sharding_conflicts({"dp": P("a", None), "fsdp": P("b", None)}, ndim=2) == P(
        "b", None
    )
    first = combine(
        one=DataParallelStrategy(axis_name="a"), two=PipelineParallelStrategy(axis_name="b", num_stages=2)
    )
    assert first.resolve_sharding_conflicts(
        {"one": P("a"), "two": P("b"), "other": P(None, "c")}, ndim=3
    ) == P("a", "c", None)


def test_merged_spec_applies(mesh42) -> None:
    spec = combine(dp=DataParallelStrategy(), tp=TensorParallelStrategy()).partition_spec(("batch", "hidden"))
    placed = jax.device_put(np.zeros((8, 4), np.float32), jax.sharding.NamedSharding(mesh42, spec))
    assert placed.sharding.shard_shape((8, 4)) == (2, 2)


def test_one_axis_over_two_dimensions_is_refused() -> None:
    combined = combine(dp=DataParallelStrategy(), fsdp=FSDPStrategy())
    with pytest.raises(
        ValueError, match=r"mesh axis 'data' would split dimensions 0 and 1 of P\('data', 'data'\)"
    ):
        combined.partition_spec(("hidden", "batch"))
    with pytest.raises(
        ValueError, match=r"the spec P\('data', None\) of 'dp' has 2 entries for an array of 1"
    ):
        combined.resolve_sharding_conflicts({"dp": P("data", None)}, ndim=1)


@pytest.mark.parametrize(
    ("strategies", "match"),
    [
        (
            {"a": DataParallelStrategy(), "b": DataParallelStrategy()},
            (
                r"Conflicting strategies: 'a' \(DataParallelStrategy\) and 'b' \(DataParallelStrategy\) "
                r"are of one kind on mesh axis 'data'"
            ),
        ),
        (
            {"a": FSDPStrategy(axis_name="x"), "b": FSDPStrategy(axis_name="x")},
            r"Conflicting .* on mesh axis 'x'",
        ),
        (
            {"dp": DataParallelStrategy(), "tp": TensorParallelStrategy(axis_name="data")},
            (
                r"Conflicting strategies: 'dp' \(DataParallelStrategy\) and 'tp' \(TensorParallelStrategy\) "
                r"both use mesh axis 'data'; only data parallelism and FSDP may share an axis"
            ),
        ),
        (
            {"tp": TensorParallelStrategy(), "pp": PipelineParallelStrategy(axis_name="model", num_stages=2)},
            r"Conflicting strategies: 'tp' .* 'pp' \(PipelineParallelStrategy\) both use mesh axis 'model'",
        ),
    ],
)
def test_conflicting_strategies_are_refused(strategies: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        combine(**strategies)


def test_the_strategies_are_copied() -> None:
    strategies = {"dp": DataParallelStrategy()}
    combined = MultiDimensionalStrategy(strategies=strategies, config=config42())
    strategies["tp"] = TensorParallelStrategy(axis_name="data")  # would conflict
    assert list(combined.strategies) == ["dp"]


def test_multi_dimensional_type_errors() -> None:
    with pytest.raises(TypeError, match=r"strategies must be a mapping from name to strategy; got list"):
        MultiDimensionalStrategy(strategies=[DataParallelStrategy()], config=config42())  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"strategies\['x'\] is a str, which lacks axis_name, partition_spec or shard"
    ):
        MultiDimensionalStrategy(strategies={"x": "data"}, config=config42())  # type: ignore[dict-item]
    with pytest.raises(
        TypeError, match=r"MultiDimensionalStrategy.config must be a ParallelismConfig; got ShardingConfig"
    ):
        MultiDimensionalStrategy(strategies={}, config=ShardingConfig())  # type: ignore[arg-type]


def test_a_strategy_of_ones_own_is_combined() -> None:
    @dataclasses.dataclass(frozen=True)
    class Heads:
        axis_name: str = "model"

        def partition_spec(self, dimension_names):
            return P(*(self.axis_name if n == "heads" else None for n in dimension_names))

        def shard(self, array, mesh):
            raise NotImplementedError

    assert isinstance(Heads(), ShardingStrategy)
    combined = combine(dp=DataParallelStrategy(), heads=Heads())
    assert combined.partition_spec(("batch", "heads", "head_dim")) == P("data", "model", None)


@pytest.mark.parametrize("module", ["substrax.mesh.strategies", "substrax.mesh._configs"])
def test_the_docstring_examples_run(module: str) -> None:
    failures, tried = doctest.testmod(
        importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert tried >= 2 and failures == 0
