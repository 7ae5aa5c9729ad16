"""One entry point for both modes: flip one word, keep the call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal, Self

import jax
from flax import nnx
from jax.sharding import Mesh

from substrax._tree import PyTree
from substrax.explicit._step import BatchSpec, explicit_train_step
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
      batch_spec: Explicit mode: how ``shard_map`` splits the batch (see
        ``explicit_train_step``). Implicit mode reads the batch's own sharding.
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
      ValueError: If ``mode`` is not ``"implicit"`` or ``"explicit"``.
    """
    return TrainStep(
        loss_fn, mode, mesh=mesh, data_axis=data_axis, batch_spec=batch_spec, has_aux=has_aux, reduce=reduce
    )


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
        self.loss_fn = loss_fn
        self.mode = mode
        self.mesh = mesh
        self.data_axis = data_axis
        self.batch_spec = batch_spec
        self.has_aux = has_aux
        self.reduce = reduce
        self._jitted = nnx.jit(self.step)

    def step(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """The un-jitted step, for use inside your own ``nnx.jit`` or ``jax.jit``."""
        if self.mode == "explicit":
            return explicit_train_step(
                model,
                optimizer,
                self.loss_fn,
                batch,
                mesh=self.mesh,
                data_axis=self.data_axis,
                batch_spec=self.batch_spec,
                has_aux=self.has_aux,
                reduce=self.reduce,
            )
        out: Any = spmd_train_step(model, optimizer, self.loss_fn, batch, has_aux=self.has_aux)
        return (out[0], reduce_metrics(out[1], self.reduce)) if self.has_aux else out

    def mesh_context(self) -> contextlib.AbstractContextManager[Any]:
        """``jax.set_mesh(self.mesh)``, or nothing when the step has no mesh of its own."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """Run one step under ``nnx.jit``, updating ``model`` and ``optimizer`` in place."""
        with self.mesh_context():
            return self._jitted(model, optimizer, batch)

    def lower(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """Lower the jitted step for these arguments, to read its HLO.

        ``step.lower(model, optimizer, batch).compile().as_text()`` shows the
        collectives XLA compiled in (``all-reduce`` and others).
        """
        with self.mesh_context():
            return self._jitted.lower(model, optimizer, batch)

    def bind(self, model: nnx.Module, optimizer: nnx.Optimizer) -> BoundTrainStep:
        """The fast spelling: split ``model`` and ``optimizer`` once, step on their arrays.

        ``nnx.jit`` walks the model's object graph on every call (split before, merge
        after), which dominates the step of a small model. The bound step does that
        once: each call runs a ``jax.jit`` pure function of the state's arrays, donated.
        See ``BoundTrainStep`` for when ``model`` and ``optimizer`` see the result.
        """
        return BoundTrainStep(self, model, optimizer)


class BoundTrainStep:
    """A ``TrainStep`` bound to one model and optimizer: ``loss = fast(batch)``.

    It owns their state while it runs. Each call donates the state's arrays to the
    jitted step and keeps the new ones, so ``model`` and ``optimizer`` hold deleted
    arrays (reading one raises jax's "Array has been deleted" error, not a stale
    value) until ``sync()`` writes the current state back into them. Used as a
    context manager, it syncs on exit::

        with step.bind(model, optimizer) as fast:
            for batch in loader:
                loss = fast(batch)
        evaluate(model)  # trained
    """

    def __init__(self, step: TrainStep, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._step = step
        graphdef, state = nnx.split((model, optimizer))
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        self._variables: list[nnx.Variable[Any]] = jax.tree.leaves(state, is_leaf=is_variable)
        self._arrays = jax.tree.leaves(state)
        treedef = jax.tree.structure(state)

        def pure(arrays: list[jax.Array], batch: PyTree) -> tuple[list[jax.Array], Any]:
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
            out = step.step(model, optimizer, batch)
            return jax.tree.leaves(nnx.state((model, optimizer))), out

        self._pure = jax.jit(pure, donate_argnums=0)

    def __call__(self, batch: PyTree) -> Any:
        """Run one step; returns the loss (or ``(loss, metrics)``)."""
        with self._step.mesh_context():
            self._arrays, out = self._pure(self._arrays, batch)
        return out

    def sync(self) -> None:
        """Write the current state into ``model`` and ``optimizer``.

        The next call donates these arrays again; sync after it to read the model.
        """
        for variable, array in zip(self._variables, self._arrays, strict=True):
            variable.set_raw_value(array)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sync()
