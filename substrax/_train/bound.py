"""The loop spelling of a ``TrainStep``: bound to one model and optimizer, the state kept as arrays."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol, Self

import jax
from flax import nnx

from substrax._base.trees import PyTree
from substrax._shared.options import StepOptions
from substrax._shared.skips import SkipWatch
from substrax._train.split import SplitState
from substrax.census import Comparison

__all__ = ["BoundTrainStep"]


class Step(Protocol):
    """What a bound step calls on its ``TrainStep``."""

    options: StepOptions

    def placed_specs(self, batch: PyTree) -> Any: ...

    def _split(
        self, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool, place: bool
    ) -> SplitState: ...

    def _run_split(self, jitted: Any, arrays: list[jax.Array], batch: PyTree, placed: Any) -> Any: ...

    def _lower(self, split: SplitState, arrays: list[jax.Array], batch: PyTree, donate: bool) -> Any: ...

    def check_communication(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree
    ) -> Comparison: ...


class BoundTrainStep:
    """A ``TrainStep`` bound to one model and optimizer: ``loss = fast(batch)``.

    It owns their state while it runs: ``model`` and ``optimizer`` hold deleted arrays until
    ``sync()`` writes the state back (leaving the ``with`` block syncs). See the modes guide.

        with step.bind(model, optimizer) as fast:
            for batch in loader:
                loss = fast(batch)
        evaluate(model)  # trained
    """

    def __init__(
        self, step: Step, model: nnx.Module, optimizer: nnx.Optimizer, *, donate: bool = True
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._step = step
        self._split = step._split(model, optimizer, donate=donate, place=True)
        self._arrays: list[jax.Array] | None = None  # None: the model holds the state (read it)
        self._donate = donate
        self._placed: Any = False  # the first batch's placement holds for the loop
        self._skips = SkipWatch(step.options.max_skips_in_a_row)

    def __call__(self, batch: PyTree) -> Any:
        """Run one step; returns the loss (or ``(loss, metrics)``). On several processes a host
        leaf of ``batch`` holds this process's rows (see the processes guide)."""
        if self._placed is False:
            self._placed = self._step.placed_specs(batch)
        consumed = self._arrays if self._arrays is not None else self._read_model()
        self._arrays, out, applied = self._step._run_split(self._split.jitted, consumed, batch, self._placed)
        if not self._donate:
            for array in consumed:  # what donation would have done: no stale copy stays readable
                array.delete()
        self._skips.push(applied)
        return out

    def _read_model(self) -> list[jax.Array]:
        """The state as ``model`` and ``optimizer`` hold it (after ``sync``, with any value set since)."""
        if not self._split.valid_for(self.model, self.optimizer):
            raise ValueError(
                "The model or optimizer changed structure inside a bind block (a module, variable "
                "or item replaced or added, or shard_state run); a set_value is fine. Leave the "
                "block (or sync) and bind again: step.bind(model, optimizer)."
            )
        return self._split.arrays()

    def lower(self, batch: PyTree) -> Any:
        """Lower the program this step runs for ``batch`` (donating as it was bound), to read its
        HLO and memory (see ``TrainStep.lower``)."""
        arrays = self._arrays if self._arrays is not None else self._read_model()
        return self._step._lower(self._split, arrays, batch, donate=self._donate)

    def check_communication(self, batch: PyTree) -> Comparison:
        """This step's census against its layout's rule (see ``TrainStep.check_communication``); syncs
        first."""
        self.sync()
        return self._step.check_communication(self.model, self.optimizer, batch)

    def census(self, batch: PyTree) -> Comparison:
        """Alias of ``BoundTrainStep.check_communication``, kept for code written against an earlier version.

        It returns a ``Comparison``, not a ``CensusReport`` (see ``TrainStep.census``).
        """
        return self.check_communication(batch)

    def sync(self) -> None:
        """Write the current state into ``model`` and ``optimizer``, and judge the last step's flag.

        The next call reads them again (a value set since, ``set_value``, is used) and
        consumes them; sync after it to read the model.
        """
        if self._arrays is not None:
            self._split.write(self._arrays)
            self._arrays = None
        self._skips.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.sync()
        elif self._arrays is not None:  # the state goes back; the error in flight is the one to see
            self._split.write(self._arrays)
            self._arrays = None
