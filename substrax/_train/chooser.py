"""One entry point for both modes, ``make_train_step``: flip one word, keep the call (see the modes guide)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax import _layout, explicit, spmd
from substrax._base import declared
from substrax._base.trees import PyTree, path_str
from substrax._batch.leaves import BatchSpec, check_batch_leaves
from substrax._batch.placement import place_process_rows
from substrax._shared.compiler import compiler_options
from substrax._shared.options import MODES, Mode, ModeSteps, StepOptions, options_from
from substrax._shared.pipeline_record import recording_pipeline
from substrax._shared.precision import MixedPrecision
from substrax._shared.scatter import rows_for
from substrax._shared.schedule import check_stage_axis
from substrax._shared.skips import DEFAULT_MAX_SKIPS, SkipWatch
from substrax._shared.update import donated_state
from substrax._train.bound import BoundTrainStep
from substrax._train.pinned import pinned_jit
from substrax._train.split import SplitState, uncommitted_as_replicated
from substrax.census import Comparison, check_communication
from substrax.mesh import current_mesh, mesh_in_effect

__all__ = ["MODES", "BoundTrainStep", "TrainStep", "make_train_step"]


_STEPS: dict[Mode, ModeSteps] = {"implicit": spmd.STEPS, "explicit": explicit.STEPS}


def make_train_step(
    loss_fn: Callable[[Any, PyTree], Any],
    mode: Mode = "implicit",
    *,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
    has_aux: bool = False,
    reduce: Mapping[str, str | None] | None = None,
    microbatches: int = 1,
    skip_nonfinite: bool = True,
    precision: MixedPrecision | None = None,
    max_skips_in_a_row: int | None = DEFAULT_MAX_SKIPS,
    replica_axis: str = "replica",
    schedule: str | None = None,
) -> TrainStep:
    """Build a jitted data-parallel step ``(model, optimizer, batch) -> loss``, in either mode.

    The one place the step's options are documented; the why is in the guides (modes,
    metrics, microbatches, nonfinite, precision, layouts). Both modes give the same loss,
    metrics and parameters to round-off, except with dropout and BatchNorm (see the modes
    guide, "Where the modes differ").

    Args:
      loss_fn: ``(model, batch) -> loss``, or ``(loss, metrics)`` with ``has_aux``; a
        mean over the batch's examples. In explicit mode it sees one device's shard.
      mode: ``"implicit"`` (XLA inserts the reduction) or ``"explicit"`` (``shard_map``).
      mesh: The mesh (the step sets it); ``None`` uses the one ``jax.set_mesh`` sets around the call.
      data_axis: The mesh axis the batch is split over; a mesh without it has a data axis of
        one device (rows not split: a pipeline or tensor parallelism alone; see the batches
        guide, "Axis roles").
      batch_spec: A ``PartitionSpec`` or a prefix tree of them. Default: a leaf placed on
        the mesh keeps its spec, any other is split over ``data_axis``.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``, metrics a flat mapping.
      reduce: With ``has_aux``, metric name to ``"mean"`` (the default), ``"sum"``,
        ``"max"``, ``"min"``, ``"gather"`` or ``None``; see the metrics guide.
      microbatches: Split each device's rows into this many, accumulating the gradient;
        the optimizer applies once (see the microbatches guide).
      skip_nonfinite: Skip an update whose loss or gradient is not finite, leaving all
        state as it was and returning the loss; warns ``SkippedStepWarning`` (default on).
      precision: A ``substrax.MixedPrecision`` policy, or ``None`` (see the precision guide).
      max_skips_in_a_row: Raise ``NonFiniteStepsError`` after this many skipped steps in a
        row (default 10); ``None`` never raises.
      replica_axis: On a mesh with this axis, hybrid sharding: rows split over it and
        ``data_axis``, ``"hsdp"`` state replicated across it (layouts guide, "Hybrid sharding").
      schedule: One of ``SCHEDULES`` (``"gpipe"``, ``"1f1b"``; ``"zb-h1"`` in explicit mode):
        on a mesh with a ``stage`` axis, run the stack ``shard_state(..., stages=)`` split over
        it as a pipeline over the ``microbatches`` (at least 2); ``None`` (the default): no
        pipeline (see the pipelines guide).

    Returns:
      A ``TrainStep``: ``step(model, optimizer, batch)`` updates both in place and returns
      the loss (or ``(loss, metrics)``); ``step.bind(model, optimizer)`` for a loop. On
      several processes both take a host batch as this process's rows, as
      ``place_batch_on_shards`` does (see the processes guide).

    Raises:
      ValueError: At once: an unknown ``mode``, ``reduce`` without ``has_aux`` or with an
        unknown operation, two roles (``data_axis``, ``replica_axis``, the stage axis) on one
        axis, ``microbatches`` below 1, an unknown ``schedule``, one with fewer than two
        microbatches, one ``mode`` does not run or a ``mesh`` without ``stage``. When called,
        before compiling: a layer's axis that is another role's, a mesh without ``data_axis``
        one axis of which has no role (a misnamed data axis), a batch that does not split
        over ``data_axis`` (or ``batch_spec``) or into ``microbatches``, a ``batch_spec`` over
        the stage axis (or its rows over a layer's axis), an output that does not match
        ``has_aux``,
        ``schedule`` on a model without a staged stack (or a staged model without
        ``schedule``), a ``reduce`` metric not returned, (explicit) state sharded other than
        by ``shard_state``, ``"hsdp"`` state placed with another ``replica_axis``, or on
        several processes a host leaf whose shape differs between them; each names the
        leaf, metric, parameter or axes.
      TypeError: If ``microbatches`` is not an int, or an axis name not a non-empty str.
    """
    options = options_from(locals())  # the keywords above, checked once
    return TrainStep(loss_fn, options)


class _PlacedSpecs(NamedTuple):
    """A batch's partition specs in a hashable form, to key the jitted step on."""

    treedef: Any
    specs: tuple[PartitionSpec, ...]

    def tree(self) -> PyTree:
        return jax.tree.unflatten(self.treedef, self.specs)


class TrainStep:
    """A data-parallel training step in one mode; ``make_train_step`` builds it.

    Args:
      loss_fn: As ``make_train_step`` takes it.
      options: Every other setting (``StepOptions``; see ``make_train_step``).
    """

    def __init__(self, loss_fn: Callable[[Any, PyTree], Any], options: StepOptions) -> None:
        if not isinstance(options, StepOptions):
            raise TypeError(f"options must be a substrax.StepOptions; got {options!r}. Use make_train_step.")
        self.options = options
        if options.mesh is not None:
            options.roles(current_mesh(options.mesh))  # two roles on one axis refused before any trace
            check_stage_axis(options.schedule, options.mesh)
        self.loss_fn = loss_fn
        # the chooser always reduces metrics (unlisted ones by their mean)
        self._step_options = options.replace(reduce=dict(options.reduce or {}) if options.has_aux else None)
        self._cached: SplitState | None = None
        self._pure_steps: dict[Any, Any] = {}
        self._skips = SkipWatch(options.max_skips_in_a_row)

    mode = property(lambda self: self.options.mode, doc="``StepOptions.mode``.")
    mesh = property(lambda self: self.options.mesh, doc="``StepOptions.mesh``.")
    data_axis = property(lambda self: self.options.data_axis, doc="``StepOptions.data_axis``.")
    batch_spec = property(lambda self: self.options.batch_spec, doc="``StepOptions.batch_spec``.")
    has_aux = property(lambda self: self.options.has_aux, doc="``StepOptions.has_aux``.")
    reduce = property(lambda self: self.options.reduce, doc="``StepOptions.reduce``.")
    microbatches = property(lambda self: self.options.microbatches, doc="``StepOptions.microbatches``.")
    precision = property(lambda self: self.options.precision, doc="``StepOptions.precision``.")
    skip_nonfinite = property(lambda self: self.options.skip_nonfinite, doc="``StepOptions.skip_nonfinite``.")
    schedule = property(lambda self: self.options.schedule, doc="``StepOptions.schedule``.")

    def placed_specs(self, batch: PyTree) -> _PlacedSpecs | None:
        """The batch's specs as placed on the mesh (others split over ``data_axis``).

        ``None`` when ``batch_spec`` is set or every leaf has the default spec.
        """
        check_batch_leaves(batch)  # outside the trace: a list is refused, a float64 leaf named
        if self.batch_spec is not None:
            return None
        leaves, treedef = jax.tree.flatten(batch)
        rows = PartitionSpec(self.options.row_axes(self.mesh or jax.sharding.get_abstract_mesh()))
        specs = []
        for leaf in leaves:
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding) and self.data_axis in sharding.mesh.axis_names:
                specs.append(sharding.spec)
            else:  # what the step's default does: rows split, a 0-d leaf replicated
                specs.append(PartitionSpec() if np.ndim(leaf) == 0 else rows)
        if all(spec == rows or np.ndim(leaf) == 0 for spec, leaf in zip(specs, leaves)):
            return None
        return _PlacedSpecs(treedef, tuple(specs))

    def step(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """The un-jitted step, for use inside your own ``nnx.jit`` (``bind`` is the ``jax.jit`` spelling).

        Inside a trace the batch's placement is not visible: without ``batch_spec`` every leaf
        is split over ``data_axis``.
        """
        return self._run(model, optimizer, batch)[0]

    def _run(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, placed: _PlacedSpecs | None = None
    ) -> Any:
        options = self._step_options
        if placed is not None:
            options = options.replace(batch_spec=placed.tree())
        return _STEPS[self.mode].run_step(model, optimizer, self.loss_fn, batch, options)

    def mesh_context(self) -> contextlib.AbstractContextManager[Any]:
        """``jax.set_mesh(self.mesh)``, or nothing when the step has no mesh of its own."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _jit(self, graphdef: Any, treedef: Any, donate: bool) -> Any:
        """The pure step for one graph, jitted: a new ``jax.jit`` (and trace) each call."""

        def pure(
            arrays: list[jax.Array], batch: PyTree, placed: _PlacedSpecs | None
        ) -> tuple[list[jax.Array], Any, Any]:
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
            # guarded update in place (substrax._shared.update); reduce-scatters as the platform takes them
            with donated_state(donate), rows_for(platform):
                out, applied = self._run(model, optimizer, batch, placed)
            return jax.tree.leaves(nnx.state((model, optimizer))), out, applied

        platform = self._platform()
        options = compiler_options(self._concrete_mesh(), self.mode)
        return pinned_jit(pure, options, donate_argnums=0 if donate else (), static_argnames="placed")

    def _pure_step(self, graphdef: Any, treedef: Any, donate: bool) -> Any:
        """The jitted pure step for one graph, made once per graph (a re-split reuses it)."""
        key = (graphdef, treedef, self._platform(), donate)  # (donate last: tests read it)
        if key not in self._pure_steps:
            self._pure_steps[key] = self._jit(graphdef, treedef, donate)
        return self._pure_steps[key]

    def _split(
        self, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool, place: bool = False
    ) -> SplitState:
        """The split for a step; ``place``: uncommitted state first put where the step leaves it."""
        _STEPS[self.mode].check_placement(model)
        split = SplitState(model, optimizer, self._pure_step, donate)
        if place:
            _check_runnable(model, optimizer)
            split.place_uncommitted(self._concrete_mesh())
        return split

    def _platform(self) -> str | None:
        """The platform of the mesh the step runs on (its compiler options follow it), or None."""
        mesh = self._concrete_mesh()
        return None if mesh is None or not mesh.devices.size else mesh.devices.flat[0].platform

    def _concrete_mesh(self) -> Mesh | None:
        """The mesh the step runs on (its own, else ``jax.set_mesh``'s), or None inside a trace."""
        mesh = mesh_in_effect(self.mesh)
        return mesh if isinstance(mesh, Mesh) else None

    def _lower(self, split: SplitState, arrays: list[jax.Array], batch: PyTree, donate: bool = False) -> Any:
        """The step lowered for these arguments, traced afresh (not from the jitted step's cache)."""
        with self.mesh_context():
            arrays = uncommitted_as_replicated(arrays, self._concrete_mesh())  # as the call places them
            placed = self.placed_specs(batch)
            return self._jit(*split.graph, donate=donate).lower(
                arrays, self._process_rows(batch, placed), placed=placed
            )

    def traced(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, *, donate: bool = True
    ) -> Any:
        """The jitted step traced for these arguments (``jax.stages.Traced``: ``.jaxpr``, ``.lower()``).

        Its arguments are the state's arrays (``nnx.state((model, optimizer))``'s leaves), then the batch's.
        ``donate``: as in ``lower``.
        """
        split = self._split(model, optimizer, donate=False)
        with self.mesh_context():
            arrays = uncommitted_as_replicated(split.arrays(), self._concrete_mesh())
            jitted = self._jit(*split.graph, donate=donate)
            placed = self.placed_specs(batch)
            return jitted.trace(arrays, self._process_rows(batch, placed), placed=placed)

    def _run_split(self, jitted: Any, arrays: list[jax.Array], batch: PyTree, placed: Any) -> Any:
        with self.mesh_context():
            return jitted(arrays, self._process_rows(batch, placed), placed=placed)

    def _process_rows(self, batch: PyTree, placed: _PlacedSpecs | None) -> PyTree:
        """On several processes, each host leaf as this process's rows (``place_batch_on_shards``)."""
        mesh = self._concrete_mesh() if jax.process_count() > 1 else None
        if mesh is None:
            return batch
        spec = self.batch_spec if placed is None else placed.tree()  # placed: only without batch_spec
        return place_process_rows(batch, spec, mesh, self.options.row_axes(mesh))

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """Run one step, updating ``model`` and ``optimizer`` in place.

        The split of the two objects is kept and checked each call; a changed structure (or a
        ``shard_state`` since) re-splits. See the modes guide, "The three spellings of a step".
        On several processes a host leaf of ``batch`` holds this process's rows (processes guide).
        """
        split = self._cached
        if split is None or not split.valid_for(model, optimizer):
            split = self._cached = self._split(model, optimizer, donate=True, place=True)
        # donated, an array someone else holds copied first (the guard's update then reads no old
        # buffer after its new value is written: substrax._shared.update._update_in_place)
        arrays = split.donatable(split.arrays())
        arrays, out, applied = self._run_split(split.jitted, arrays, batch, self.placed_specs(batch))
        split.write(arrays)
        self._skips.push(applied)
        return out

    def lower(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, *, donate: bool = True
    ) -> Any:
        """Lower the jitted step for these arguments (traced afresh), e.g. ``.compile().memory_analysis()``.

        ``donate=True`` (the default): the program the plain call and ``.bind`` run, the state
        donated (updated in place); ``False``: the one ``.bind(..., donate=False)`` runs.
        Lowering itself donates nothing.
        """
        split = self._split(model, optimizer, donate=False)
        return self._lower(split, split.arrays(), batch, donate=donate)

    def check_communication(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Comparison:
        """Every collective of this step compiled for these arguments, held against its layout's rule.

        Returns a ``Comparison``: print it; ``.matches`` and ``.report`` (the ``CensusReport``).
        See the census guide and ``substrax.compare``.
        """
        # what the layers declare they communicate, and which units ran one layer at a time
        with (
            declared.recording() as layers,
            _layout.recording_layers() as layered,
            recording_pipeline() as piped,
        ):
            lowered = self.lower(model, optimizer, batch)  # as it runs: donated
        return check_communication(
            lowered,
            model,
            optimizer,
            self.options,
            layers=layers,
            layered=layered,
            pipeline=piped[0] if piped else None,
        )

    def census(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Comparison:
        """Alias of ``check_communication`` (a ``Comparison``; the ``CensusReport`` is its ``.report``)."""
        return self.check_communication(model, optimizer, batch)

    def bind(self, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool = True) -> BoundTrainStep:
        """The loop spelling: split ``model`` and ``optimizer`` once, step on their arrays.

        Args:
          model: The model to train.
          optimizer: Its optimizer.
          donate: Whether each call donates the state's arrays to the step (updated in place);
            ``False`` frees them after the step instead (see the modes guide).

        Returns:
          A ``BoundTrainStep``; see it for when ``model`` and ``optimizer`` see the result.
        """
        return BoundTrainStep(self, model, optimizer, donate=donate)


def _check_runnable(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Raise where the state holds an abstract leaf: a step runs on arrays."""
    for owner, tree in (("model", model), ("optimizer", optimizer)):
        for path, variable in _layout.flat_state(tree):
            if isinstance(variable.get_value(), jax.ShapeDtypeStruct):
                raise TypeError(
                    f"{path_str(path, owner)} is abstract (a jax.ShapeDtypeStruct, as nnx.eval_shape makes "
                    f"it): a step lowers and compiles for abstract state (step.lower(...).compile(), "
                    f"check_communication, substrax.plan) but runs on arrays. Build the model and "
                    f"optimizer outside nnx.eval_shape, on a mesh of devices that run (not topology_mesh's)."
                )
