"""One entry point for both modes: flip one word, keep the call.

``TrainStep`` only picks a step function (``spmd_train_step`` or
``explicit_train_step``) and runs it fast: it splits the model and optimizer once
(``substrax._train.split.SplitState``), runs a ``jax.jit`` pure function of their arrays, and writes the new
arrays back. Layouts and microbatches live in the step functions, not here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax import _layout
from substrax._batch.leaves import check_batch_leaves
from substrax._shared.options import MODES, Mode, StepOptions
from substrax._shared.precision import MixedPrecision
from substrax._shared.skips import DEFAULT_MAX_SKIPS, SkipWatch
from substrax._train.bound import BoundTrainStep
from substrax._train.split import SplitState
from substrax._tree import PyTree
from substrax.census import Comparison
from substrax.census._step import check_communication
from substrax.explicit import _step as explicit_step
from substrax.explicit._step import BatchSpec
from substrax.mesh import current_mesh
from substrax.nn import _declared as declared
from substrax.spmd import _step as implicit_step

__all__ = ["MODES", "BoundTrainStep", "TrainStep", "make_train_step"]



class _ModeSteps(NamedTuple):
    """What the chooser calls of one mode: its step on ``StepOptions`` and its placement check."""

    run_step: Callable[[nnx.Module, nnx.Optimizer, Callable[..., Any], PyTree, StepOptions], tuple[Any, Any]]
    check_placement: Callable[[nnx.Module], None]


_STEPS: dict[Mode, _ModeSteps] = {
    "implicit": _ModeSteps(implicit_step.run_step, implicit_step.check_placement),
    "explicit": _ModeSteps(explicit_step.run_step, explicit_step.check_placement),
}


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
) -> TrainStep:
    """Build a jitted data-parallel step ``(model, optimizer, batch) -> loss``, in either mode.

    ``"implicit"`` differentiates the global batch's loss under ``jax.jit`` and lets XLA
    insert the gradient reduction (``substrax.spmd.spmd_train_step``). ``"explicit"``
    runs the step under ``jax.shard_map``, ``pmean``-ing the loss before ``grad`` and
    writing every collective out (``substrax.explicit.explicit_train_step``). Both
    train a replicated model or one placed by ``substrax.shard_state`` (ZeRO-1, FSDP),
    and keep its layout. Both take the same batch and return the same loss, metrics and
    parameters to round-off, except with dropout (explicit mode draws a mask per
    device, and per microbatch) and with BatchNorm-style state (explicit mode
    normalizes each device's shard, unless the layer has ``axis_name=data_axis``).

    Args:
      loss_fn: ``(model, batch) -> loss``, or ``(loss, metrics)`` with ``has_aux``; a
        mean over the batch's examples. In explicit mode it sees one device's shard.
      mode: ``"implicit"`` or ``"explicit"``.
      mesh: The mesh. ``None`` uses the one set by ``jax.set_mesh`` around the call;
        given, the step sets it itself.
      data_axis: The mesh axis the batch is split over.
      batch_spec: How the batch is split over the mesh: one ``PartitionSpec``, or a
        prefix tree of them (rows on ``data_axis``, a batch-level value ``P()``).
        Default: a leaf already placed on a ``NamedSharding`` of the mesh (by
        ``place_batch_on_shards``) keeps its spec, any other is split over
        ``data_axis``.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``, ``metrics`` a flat
        mapping from name to value.
      reduce: With ``has_aux``, metric name to ``"mean"``, ``"sum"``, ``"max"``,
        ``"min"``, ``"gather"`` (per-example values of the global batch, in order) or
        ``None``. Unlisted metrics get ``"mean"``. Both modes give the same values,
        except ``None``: implicit keeps the global value, explicit stacks per-device
        values.
      microbatches: Split each device's rows into this many equal microbatches (in
        order), accumulate their gradients, and apply the optimizer once with the
        gradient of the whole batch's mean loss. Explicit mode reduces the gradient
        once per step, after the loop; each device holds a full-size gradient
        accumulator (under FSDP, the whole parameters too) for the step. Metrics are
        reduced over the whole batch.
      skip_nonfinite: When the loss or any gradient element is NaN or infinite, skip
        the update in the graph: the model, its BatchNorm statistics and the optimizer
        (its step count too) keep the values they had, and the step returns the
        non-finite loss, so the caller sees it. On by default: no step leaves
        non-finite state. ``False`` applies every update. A skipped step warns
        (``SkippedStepWarning``, with the count) when its flag is read (eight at a time, and at ``sync``).
      precision: A ``substrax.MixedPrecision`` policy (bfloat16 compute and gathers,
        float32 state and update; see ``substrax._shared.precision``), or ``None``.
      max_skips_in_a_row: Raise ``NonFiniteStepsError`` once this many steps in a row
        were skipped (default 10); ``None`` never raises.
      replica_axis: On a mesh with this axis, hybrid sharding: the batch's rows are
        split over it and ``data_axis`` together, the state (``layout="hsdp"``) split
        over ``data_axis`` within a replica and replicated across; the gradient is
        reduce-scattered over ``data_axis``, then all-reduced over ``replica_axis`` at
        its slice's size, once per step (see the layouts guide, "Hybrid sharding").

    Returns:
      A ``TrainStep``: call it as ``step(model, optimizer, batch)``; it updates
      ``model`` and ``optimizer`` in place and returns the loss (or
      ``(loss, metrics)``). ``step.bind(model, optimizer)`` gives the spelling that
      also skips writing the state back after every step.

    Raises:
      ValueError: At once: if ``mode`` is not ``"implicit"`` or ``"explicit"``,
        ``reduce`` is given without ``has_aux`` or names an unknown operation, ``mesh``
        lacks ``data_axis``, or ``microbatches`` is below 1. When called: if the batch
        cannot be split over ``data_axis`` (or ``batch_spec``) or into
        ``microbatches``, if ``loss_fn``'s output does not match ``has_aux``, if
        ``reduce`` names a metric ``loss_fn`` does not return, and, in explicit mode,
        if the model's state is sharded other than by ``shard_state``; each message
        names the leaf, metric or parameter.
      TypeError: If ``microbatches`` is not an int.
    """
    options = StepOptions(
        mode=mode,
        mesh=mesh,
        data_axis=data_axis,
        batch_spec=batch_spec,
        has_aux=has_aux,
        reduce=reduce,
        microbatches=microbatches,
        skip_nonfinite=skip_nonfinite,
        precision=precision,
        max_skips_in_a_row=max_skips_in_a_row,
        replica_axis=replica_axis,
    )
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
      options: Every other setting, whole (``StepOptions``; ``make_train_step`` documents each).
    """

    def __init__(self, loss_fn: Callable[[Any, PyTree], Any], options: StepOptions) -> None:
        if not isinstance(options, StepOptions):
            raise TypeError(f"options must be a substrax.StepOptions; got {options!r}. Use make_train_step.")
        self.options = options
        if options.mesh is not None:
            current_mesh(options.mesh, required_axes=(options.data_axis,))
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

    def placed_specs(self, batch: PyTree) -> _PlacedSpecs | None:
        """How ``batch`` is already laid out, when no ``batch_spec`` was given.

        A leaf placed on a ``NamedSharding`` of a mesh with ``data_axis`` keeps its spec
        (a prefix placement of ``place_batch_on_shards``: rows on the data axis, a
        batch-level value replicated); any other leaf gets ``PartitionSpec(data_axis)``,
        or ``PartitionSpec()`` when it is 0-d. Refuses a Python list in ``batch`` and
        warns about a float64 leaf jax would cast (``check_batch_leaves``).
        ``None`` when ``batch_spec`` was given or nothing is placed so.
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
        """The un-jitted step, for use inside your own ``nnx.jit``.

        Under a plain ``jax.jit`` the in-place update of ``model`` and ``optimizer``
        would not leave the traced function; ``bind`` is the ``jax.jit`` spelling.
        Inside a trace the batch's placement is not visible: without ``batch_spec``
        every leaf is split over ``data_axis``.
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
            out, applied = self._run(model, optimizer, batch, placed)
            return jax.tree.leaves(nnx.state((model, optimizer))), out, applied

        return jax.jit(pure, donate_argnums=0 if donate else (), static_argnames="placed")

    def _pure_step(self, graphdef: Any, treedef: Any, donate: bool) -> Any:
        """The jitted pure step for one graph, made once per graph (a re-split reuses it)."""
        key = (graphdef, treedef, donate)
        if key not in self._pure_steps:
            self._pure_steps[key] = self._jit(graphdef, treedef, donate)
        return self._pure_steps[key]

    def _split(self, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool) -> SplitState:
        _STEPS[self.mode].check_placement(model)
        return SplitState(model, optimizer, self._pure_step, donate)

    def _lower(self, split: SplitState, arrays: list[jax.Array], batch: PyTree) -> Any:
        """The step lowered for these arguments, traced afresh (not from the jitted step's cache)."""
        with self.mesh_context():
            return self._jit(*split.graph, donate=False).lower(arrays, batch, placed=self.placed_specs(batch))

    def _run_split(self, jitted: Any, arrays: list[jax.Array], batch: PyTree, placed: Any) -> Any:
        with self.mesh_context():
            return jitted(arrays, batch, placed=placed)

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """Run one step, updating ``model`` and ``optimizer`` in place.

        The first call splits ``model`` and ``optimizer`` into their graph and arrays
        and keeps the split; later calls on the same two objects reuse it, after
        checking, attribute by attribute, that no module, variable or setting was
        replaced or added (``model.eval()``, a new layer) and that
        ``substrax.shard_state`` did not run since; any such change re-splits.
        """
        split = self._cached
        if split is None or not split.valid_for(model, optimizer):
            split = self._cached = self._split(model, optimizer, donate=False)
        arrays = split.arrays()
        # donated when nobody else reads them, and not under the non-finite guard: its select of
        # old or new state makes XLA copy every donated buffer (measured: 1.7x the step, MLP w1024)
        jitted = split.jitted_for(not self.options.skip_nonfinite and split.unshared(arrays))
        arrays, out, applied = self._run_split(jitted, arrays, batch, self.placed_specs(batch))
        split.write(arrays)
        self._skips.push(applied)
        return out

    def lower(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """Lower the jitted step for these arguments, to read its HLO; traced afresh each call.

        ``step.lower(model, optimizer, batch).compile().as_text()`` shows the
        collectives XLA compiled in (``all-reduce`` and others).
        """
        split = self._split(model, optimizer, donate=False)
        return self._lower(split, split.arrays(), batch)

    def check_communication(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Comparison:
        """Every collective of this step compiled for these arguments, held against its layout's rule.

        ``print(step.check_communication(model, optimizer, batch))`` shows the census (one
        row per collective), the expected and compiled bytes per source and kind, and each
        difference; ``.matches`` says whether they agree, and ``.report`` is the census
        itself (the ``CensusReport`` that ``substrax.census`` gives of the compiled step).
        See ``substrax.compare`` for the rule.
        """
        # what the layers declare they communicate, and which units ran one layer at a time
        with declared.recording() as layers, _layout.recording_layers() as layered:
            lowered = self.lower(model, optimizer, batch)
        return check_communication(lowered, model, optimizer, self.options, layers=layers, layered=layered)

    def census(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Comparison:
        """Alias of ``TrainStep.check_communication``, kept for code written against an earlier version.

        It returns a ``Comparison`` (the check), not the ``CensusReport`` that
        ``substrax.census`` returns; the census is the comparison's ``.report``.
        """
        return self.check_communication(model, optimizer, batch)

    def bind(self, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool = True) -> BoundTrainStep:
        """The loop spelling: split ``model`` and ``optimizer`` once, step on their arrays.

        Unlike the plain call it does not write the state back after every step (nor
        check the model's graph): see ``BoundTrainStep``.

        Args:
          model: The model to train.
          optimizer: Its optimizer.
          donate: Whether each call donates the state's arrays to the step, so XLA
            updates them in place (the state then takes its memory once, not twice).
            ``False`` frees them after the step instead: on the CPU the explicit step
            ran faster so at large widths (README, Benchmarks).

        Returns:
          A ``BoundTrainStep``; see it for when ``model`` and ``optimizer`` see the
          result.
        """
        return BoundTrainStep(self, model, optimizer, donate=donate)
