"""One entry point for both modes: flip one word, keep the call."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal, NamedTuple, Self

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax._placement import batch_partition_specs
from substrax._reductions import split_loss_output
from substrax._tree import PyTree, path_str
from substrax.explicit._step import BatchSpec, explicit_train_step
from substrax.mesh import current_mesh
from substrax.spmd._metrics import reduce_metrics
from substrax.spmd._step import spmd_train_step

__all__ = ["MODES", "BoundTrainStep", "TrainStep", "make_train_step"]

Mode = Literal["implicit", "explicit"]
MODES: tuple[Mode, ...] = ("implicit", "explicit")


def make_train_step(
    loss_fn: Callable[[Any, PyTree], Any],
    mode: Mode = "implicit",
    *,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
    has_aux: bool = False,
    reduce: Mapping[str, str | None] | None = None,
) -> TrainStep:
    """Build a jitted data-parallel step ``(model, optimizer, batch) -> loss``, in either mode.

    ``"implicit"`` differentiates the global batch's loss under ``nnx.jit`` and lets XLA
    insert the gradient all-reduce (``substrax.spmd.spmd_train_step``). ``"explicit"``
    runs the step under ``jax.shard_map``, ``pmean``-ing the loss before ``grad`` and
    reducing metrics with collectives (``substrax.explicit.explicit_train_step``).
    Both take the same batch and return the same values to round-off.

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
        ``data_axis``. Explicit mode gives it to ``shard_map``; implicit mode constrains
        the batch to it, so a host batch is split too.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``, ``metrics`` a flat
        mapping from name to value.
      reduce: With ``has_aux``, metric name to ``"mean"``, ``"sum"``, ``"max"``,
        ``"min"``, ``"gather"`` (per-example values of the global batch) or ``None``.
        Unlisted metrics get ``"mean"``. Both modes give the same values, except
        ``None``: implicit keeps the global value, explicit stacks per-device values.

    Returns:
      A ``TrainStep``: call it as ``step(model, optimizer, batch)``; it updates
      ``model`` and ``optimizer`` in place and returns the loss (or
      ``(loss, metrics)``). ``step.bind(model, optimizer)`` gives the faster spelling
      for a training loop.

    Raises:
      ValueError: If ``mode`` is not ``"implicit"`` or ``"explicit"``, or ``reduce`` is
        given without ``has_aux``. When called: if the batch cannot be split over
        ``data_axis`` (or ``batch_spec``), if ``loss_fn``'s output does not match
        ``has_aux``, if ``reduce`` names a metric ``loss_fn`` does not return, and, in
        explicit mode, if a model's state is sharded; each message names the leaf,
        metric or parameter.
    """
    return TrainStep(
        loss_fn, mode, mesh=mesh, data_axis=data_axis, batch_spec=batch_spec, has_aux=has_aux, reduce=reduce
    )


class _PlacedSpecs(NamedTuple):
    """A batch's partition specs in a hashable form, to key the jitted step on."""

    treedef: Any
    specs: tuple[PartitionSpec, ...]

    def tree(self) -> PyTree:
        return jax.tree.unflatten(self.treedef, self.specs)


class TrainStep:
    """A data-parallel training step in one mode; see ``make_train_step``."""

    def __init__(
        self,
        loss_fn: Callable[[Any, PyTree], Any],
        mode: Mode = "implicit",
        *,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        batch_spec: BatchSpec | None = None,
        has_aux: bool = False,
        reduce: Mapping[str, str | None] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
        if reduce is not None and not has_aux:
            raise ValueError("reduce= says how to reduce metrics, which loss_fn returns only with has_aux=True.")
        self.loss_fn = loss_fn
        self.mode = mode
        self.mesh = mesh
        self.data_axis = data_axis
        self.batch_spec = batch_spec
        self.has_aux = has_aux
        self.reduce = reduce
        self._jitted = nnx.jit(self._run, static_argnames="placed")
        self._checked_models: set[int] = set()

    def placed_specs(self, batch: PyTree) -> _PlacedSpecs | None:
        """How ``batch`` is already laid out, when no ``batch_spec`` was given.

        A leaf placed on a ``NamedSharding`` of a mesh with ``data_axis`` keeps its spec
        (a prefix placement of ``place_batch_on_shards``: rows on the data axis, a
        batch-level value replicated); any other leaf gets ``PartitionSpec(data_axis)``.
        ``None`` when ``batch_spec`` was given or nothing is placed so.
        """
        if self.batch_spec is not None:
            return None
        leaves, treedef = jax.tree.flatten(batch)
        specs = []
        for leaf in leaves:
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding) and self.data_axis in sharding.mesh.axis_names:
                specs.append(sharding.spec)
            else:
                specs.append(PartitionSpec(self.data_axis))
        if all(spec == PartitionSpec(self.data_axis) for spec in specs):
            return None
        return _PlacedSpecs(treedef, tuple(specs))

    def _check_model(self, model: nnx.Module) -> None:
        """Explicit mode replicates the model: refuse one whose state is sharded (once per model)."""
        if self.mode != "explicit" or id(model) in self._checked_models:
            return
        for path, variable in nnx.to_flat_state(nnx.state(model)):
            sharding = getattr(variable.get_value(), "sharding", None)
            if isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated:
                raise ValueError(
                    f"{path_str(path, 'model')} is sharded as {sharding.spec}, but the explicit "
                    f"step replicates the model on every device (its state's in_specs are P()), "
                    f"which would gather it whole. Replicate it (NamedSharding(mesh, "
                    f"PartitionSpec())), or use mode='implicit', where XLA follows the "
                    f"parameters' shardings."
                )
        self._checked_models.add(id(model))

    def step(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """The un-jitted step, for use inside your own ``nnx.jit``.

        Under a plain ``jax.jit`` the in-place update of ``model`` and ``optimizer``
        would not leave the traced function; ``bind`` is the ``jax.jit`` spelling.
        Inside a trace the batch's placement is not visible: without ``batch_spec``
        every leaf is split over ``data_axis``.
        """
        return self._run(model, optimizer, batch)

    def _run(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, placed: _PlacedSpecs | None = None) -> Any:
        batch_spec = placed.tree() if placed is not None else self.batch_spec
        if self.mode == "explicit":
            return explicit_train_step(
                model,
                optimizer,
                self.loss_fn,
                batch,
                mesh=self.mesh,
                data_axis=self.data_axis,
                batch_spec=batch_spec,
                has_aux=self.has_aux,
                reduce=self.reduce,
            )
        # Split the batch over data_axis as the explicit step does, whatever sharding it
        # arrived with: a host batch would otherwise run whole on every device.
        mesh = current_mesh(self.mesh, required_axes=(self.data_axis,))
        specs = batch_partition_specs(batch, batch_spec, mesh, self.data_axis)
        batch = jax.lax.with_sharding_constraint(batch, specs)

        def checked_loss(model: nnx.Module, batch: PyTree) -> Any:
            loss, metrics = split_loss_output(self.loss_fn(model, batch), self.has_aux)
            return (loss, metrics) if self.has_aux else loss

        out: Any = spmd_train_step(model, optimizer, checked_loss, batch, has_aux=self.has_aux)
        return (out[0], reduce_metrics(out[1], self.reduce)) if self.has_aux else out

    def mesh_context(self) -> contextlib.AbstractContextManager[Any]:
        """``jax.set_mesh(self.mesh)``, or nothing when the step has no mesh of its own."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """Run one step under ``nnx.jit``, updating ``model`` and ``optimizer`` in place."""
        self._check_model(model)
        with self.mesh_context():
            return self._jitted(model, optimizer, batch, placed=self.placed_specs(batch))

    def lower(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """Lower the jitted step for these arguments, to read its HLO.

        ``step.lower(model, optimizer, batch).compile().as_text()`` shows the
        collectives XLA compiled in (``all-reduce`` and others).
        """
        with self.mesh_context():
            return self._jitted.lower(model, optimizer, batch, placed=self.placed_specs(batch))

    def bind(self, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool = True) -> BoundTrainStep:
        """The fast spelling: split ``model`` and ``optimizer`` once, step on their arrays.

        ``nnx.jit`` walks the model's object graph on every call (split before, merge
        after), which dominates the step of a small model. The bound step does that
        once: each call runs a ``jax.jit`` pure function of the state's arrays.

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
        self._check_model(model)
        return BoundTrainStep(self, model, optimizer, donate=donate)


class BoundTrainStep:
    """A ``TrainStep`` bound to one model and optimizer: ``loss = fast(batch)``.

    It owns their state while it runs. Each call consumes the state's arrays (donates
    them to the jitted step, or deletes them after it) and keeps the new ones, so
    ``model`` and ``optimizer`` hold deleted arrays (reading one raises jax's "Array
    has been deleted" error, not a stale value) until ``sync()`` writes the current
    state back into them. Used as a context manager, it syncs on exit::

        with step.bind(model, optimizer) as fast:
            for batch in loader:
                loss = fast(batch)
        evaluate(model)  # trained
    """

    def __init__(
        self, step: TrainStep, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool = True
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._step = step
        graphdef, state = nnx.split((model, optimizer))
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        self._variables: list[nnx.Variable[Any]] = jax.tree.leaves(state, is_leaf=is_variable)
        self._arrays = jax.tree.leaves(state)
        treedef = jax.tree.structure(state)

        def pure(arrays: list[jax.Array], batch: PyTree, placed: _PlacedSpecs | None) -> tuple[list[jax.Array], Any]:
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
            out = step._run(model, optimizer, batch, placed)
            return jax.tree.leaves(nnx.state((model, optimizer))), out

        self._donate = donate
        self._jitted = jax.jit(pure, donate_argnums=0 if donate else (), static_argnames="placed")
        self._pure: Callable[[list[jax.Array], PyTree], tuple[list[jax.Array], Any]] | None = None

    def __call__(self, batch: PyTree) -> Any:
        """Run one step; returns the loss (or ``(loss, metrics)``)."""
        if self._pure is None:  # the first batch's placement holds for the loop
            self._pure = functools.partial(self._jitted, placed=self._step.placed_specs(batch))
        consumed = self._arrays
        with self._step.mesh_context():
            self._arrays, out = self._pure(consumed, batch)
        if not self._donate:
            for array in consumed:  # what donation would have done: no stale copy stays readable
                array.delete()
        return out

    def sync(self) -> None:
        """Write the current state into ``model`` and ``optimizer``.

        The next call consumes these arrays again; sync after it to read the model.
        """
        for variable, array in zip(self._variables, self._arrays, strict=True):
            variable.set_raw_value(array)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sync()
