"""The parity fuzzer's checks: a draw's run held to its reference runs, within tolerances from
the noise floor they measure (``tests/test_fuzz.py``'s docstring); ``check`` runs both and
compares them."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import numpy as np
from fuzz_device import DeviceRun, device_run, first_line
from fuzz_reference import Run, reference_runs, within_group_permutation
from fuzz_space import Config, batch_parts

STRICT_RTOL, STRICT_ATOL = 1e-5, 1e-6
SAFETY, FLOOR_EPS = 4.0, 1e-7
FLOOR_RUNS = 3  # permuted reference runs per draw, besides the reference itself
# The bfloat16 tolerance of a precision draw (test_fuzz.py's docstring, "Precision draws"),
# measured on 76 precision draws with 16 valid one-device runs each (the reference, 3 permuted,
# 12 split), holding the runs left out against the tolerance from the first K:
# - the floor: in bfloat16 most permuted runs round to the same bits as the reference, and an
#   adaptive step turns a gradient element at round-off into a whole step either way; with
#   K = 5 (a float32 draw's runs) 62 of 912 held-out valid runs fell outside, with K = 8 6 of
#   684, with K = 14 1 of 228 (the step under test: 0 of 73). So a precision draw has
#   BF16_SPLIT_RUNS more split runs (K = 14), each one run of the compiled reference step.
# - BF16_RTOL, on the loss and the metrics only (computed in bfloat16; the state is float32,
#   held to its floor): one bfloat16 unit in the last place, 2**-7 relative. The largest
#   relative excess of a held-out run's loss or metric over its floor rule was 6.4e-3
#   (1.64 x 2**-8) at K = 5, 7.9e-4 at K = 8, none at K = 14: a per-example loss a unit apart
#   where every run of the floor rounded alike.
BF16_RTOL = 2.0**-7
BF16_SPLIT_RUNS = 9  # permuted split runs in a precision draw, besides the unpermuted one (float32: 1)
BF16_U = 2.0**-8  # bfloat16's unit round-off
# The first gradient's bound under a policy (test_fuzz.py's docstring, "The first step's
# gradient"), in units of u x max|g|: a gradient element sums products whose factors (a
# parameter, the batch, the activations and cotangents of a dozen layers) and partial sums are
# each rounded once to bfloat16, at most u relative each. Measured on 10 precision draws against
# float32: kernels 0.9-3.2 u; biases whose rows cancel up to 35 u, each within SAFETY x its
# floor (the worst deviation 0.22x its tolerance; in a make fuzz sample of 36 draws, 0.26x). A
# zeroed gradient is 16x the first term.
BF16_GRADIENT_ROUNDINGS = 16


@dataclasses.dataclass
class Deviation:
    """One quantity's comparison: the largest |got - want| and the worst element's error in
    tolerances, with where it was and that element's floor and tolerance."""

    abs: float = 0.0
    ratio: float = 0.0
    where: str = ""
    floor: float = 0.0
    tol: float = 0.0
    shapes: list[str] = dataclasses.field(default_factory=list)  # values whose shapes differ

    def add(
        self,
        config: Config,
        got: Any,
        want: Any,
        floor: float,
        where: str,
        *,
        computed: bool = True,
        tol: float | None = None,
    ) -> None:
        """Fold in one comparison; ``computed``: a value the loss function computes (the loss, a
        metric), not the float32 state; ``tol``: the tolerance, given (else the floor rule's)."""
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape:
            self.shapes.append(f"{where}: shape {got.shape}, reference {want.shape}")
            return
        diff = np.abs(got - want)
        if tol is None:
            tol = atol_for(config, floor) + rtol_for(config, computed=computed) * np.abs(want)
        tol = np.broadcast_to(np.asarray(tol, np.float64), want.shape)
        ratios = diff / tol
        worst = int(np.argmax(ratios)) if ratios.size else 0
        ratio = float(ratios.flat[worst]) if ratios.size else 0.0
        if not np.all(np.isfinite(got)):
            ratio = float("inf")
        if ratio > self.ratio or not self.where:
            self.ratio, self.where, self.floor = ratio, where, floor
            self.tol = float(tol.flat[worst]) if tol.size else 0.0
        self.abs = max(self.abs, float(np.max(diff, initial=0.0)))

    @property
    def problems(self) -> list[str]:
        if self.ratio <= 1.0:
            return self.shapes
        off = (
            f"off the reference: worst {self.where}, |diff| up to {self.abs:.2e}, {self.ratio:.1f}x its "
            f"tolerance {self.tol:.1e} (measured floor there {self.floor:.1e})"
        )
        return [*self.shapes, off]

    def __str__(self) -> str:
        return f"{self.abs:.1e}({self.ratio:.2f})"


def atol_for(config: Config, floor: float) -> float:
    """The absolute tolerance: the measured floor (x SAFETY) under Adam-like steps and under a
    precision policy; strict under SGD, unless the floor itself is above the strict tolerance
    (BatchNorm on a few rows)."""
    if config.adaptive or config.precision is not None or floor > STRICT_ATOL:
        return max(STRICT_ATOL, SAFETY * floor + FLOOR_EPS)
    return STRICT_ATOL


def rtol_for(config: Config, *, computed: bool) -> float:
    """The relative tolerance: ``BF16_RTOL`` for the loss and the metrics under a precision
    policy (computed in bfloat16), else strict (the parameters and the optimizer state stay
    float32; what bfloat16 does to them, through the gradients, is in their floor)."""
    return BF16_RTOL if computed and config.precision is not None else STRICT_RTOL


@dataclasses.dataclass
class Result:
    config: Config
    problems: list[str]
    deviations: dict[str, Deviation]
    floors: dict[str, float]
    census: str = "-"
    gradients: str = "-"
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time: the machine is shared, wall time says little
    # parameters whose first gradient's tolerance is at least its largest element: their
    # gradient zeroed would pass (zero but for round-off, or below bfloat16's round-off of the
    # terms it sums)
    blind: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        devs = " ".join(f"{name} {d}" for name, d in self.deviations.items())
        floors = "/".join(f"{self.floors.get(k, 0.0):.0e}" for k in ("loss", "gradient", "state", "metrics"))
        return (
            f"{'ok  ' if self.ok else 'FAIL'} {self.seconds:4.1f}s/{self.cpu_seconds:4.1f}cpu "
            f"{self.config.short()} | {devs} | "
            f"floor l/g/s/m {floors} | census {self.census} grads {self.gradients}"
            + ("" if not self.blind else f" | blind {','.join(self.blind)}")
            + ("" if self.ok else f" | {self.problems[0][:160]}")
        )

    def report(self) -> str:
        lines = [f"check({self.config!r}).assert_ok()", *(f"  - {p}" for p in self.problems)]
        devs = ", ".join(f"{name} {d} worst at {d.where or '-'}" for name, d in self.deviations.items())
        floors = ", ".join(f"{name} {v:.1e}" for name, v in self.floors.items())
        lines.append(f"  max |diff| (worst in tolerances): {devs}; largest floors: {floors}")
        return "\n".join(lines)

    def assert_ok(self) -> None:
        assert self.ok, self.report()


def _floors(config: Config, runs: list[Run]) -> tuple[float, dict[str, float], dict[str, float]]:
    """The largest deviation between any two of the reference runs: over the losses, per metric, per leaf."""
    pairs = [(a, b) for i, a in enumerate(runs) for b in runs[i + 1 :]]
    loss = max((abs(x - y) for a, b in pairs for x, y in zip(a.losses, b.losses, strict=True)), default=0.0)
    metrics = {
        name: max(
            maxdiff(a.metrics[t][name], b.metrics[t][name]) for a, b in pairs for t in range(config.steps)
        )
        for name in runs[0].metrics[0]
    }
    state = {name: max(maxdiff(a.state[name], b.state[name]) for a, b in pairs) for name in runs[0].state}
    return loss, metrics, state


def maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b), initial=0.0))


@dataclasses.dataclass
class Reference:
    """What ``check`` holds a draw to: the reference runs (the first as drawn, the rest the
    floor's) and, under a precision policy, the first step's float32 gradient (no policy)."""

    runs: list[Run]
    gradient32: dict[str, np.ndarray] | None = None

    @property
    def gradient(self) -> dict[str, np.ndarray]:
        """The first step's gradient the step's is held to: float32, without a policy too."""
        return self.runs[0].gradient if self.gradient32 is None else self.gradient32


def reference(config: Config, batches: list[dict]) -> Reference:
    """The reference runs of ``config`` (test_fuzz.py's docstring), and its float32 gradient under
    a policy."""
    permutations = [within_group_permutation(config, s) for s in range(1, FLOOR_RUNS + 1)]
    runs = reference_runs(config, batches, [None, *permutations])
    if config.precision is None:
        split = [within_group_permutation(config, 0, split=True)]
    else:  # rows moved across the slices: other partial sums (_sliced_low_precision_value_and_grad)
        split = [within_group_permutation(config, 100 + s) for s in range(BF16_SPLIT_RUNS)]
        # and the parts' bfloat16 gradients added in the other order, as devices add them
        # (test_regression_bf16_gradients_added_device_by_device)
        half = BF16_SPLIT_RUNS // 2
        runs += reference_runs(config, batches, [None, *split[half:]], split=True, by_device=True)
        split = split[:half]
    runs += reference_runs(config, batches, [None, *split], split=True)
    if config.precision is None:
        return Reference(runs)
    plain = dataclasses.replace(config, precision=None)  # the same groups of rows, in float32
    return Reference(runs, reference_runs(plain, batches[:1], [None])[0].gradient)


def batches_of(config: Config) -> list[dict]:
    """Every step's batch, as named parts (``fuzz_space.batch_parts``)."""
    return [batch_parts(config, s) for s in range(config.steps)]


@functools.lru_cache(maxsize=32)
def kept_reference(config: Config) -> Reference:
    """``reference(config, batches_of(config))``, kept (a few kB a draw): the mutation test
    holds its runs to the reference of a draw another test checks."""
    return reference(config, batches_of(config))


def gradient_floors(config: Config, ref: Reference) -> dict[str, float]:
    """Each parameter's floor on the first step's gradient, by path: the largest deviation
    between any two reference runs; under a policy, of a bfloat16 reference run from float32."""
    if config.precision is None:
        pairs = [(a, b) for i, a in enumerate(ref.runs) for b in ref.runs[i + 1 :]]
        return {
            name: max((maxdiff(a.gradient[name], b.gradient[name]) for a, b in pairs), default=0.0)
            for name in ref.gradient
        }
    return {name: max(maxdiff(r.gradient[name], g) for r in ref.runs) for name, g in ref.gradient.items()}


def gradient_tolerance(config: Config, want: np.ndarray, floor: float) -> float | None:
    """A parameter's tolerance on the first step's gradient (test_fuzz.py's docstring, "The first
    step's gradient"): None (the floor rule) without a policy; under one, ``BF16_GRADIENT_ROUNDINGS``
    units of bfloat16 round-off of the leaf's largest float32 element, plus its floor."""
    if config.precision is None:
        return None
    return BF16_GRADIENT_ROUNDINGS * BF16_U * float(np.max(np.abs(want), initial=0.0)) + SAFETY * floor


def compare(config: Config, ref: Reference, got: DeviceRun) -> Result:
    """Hold the step's run to the reference."""
    runs = ref.runs
    loss_floor, metric_floors, state_floors = _floors(config, runs)
    grad_floors = gradient_floors(config, ref)
    floors = {
        "loss": loss_floor,
        "state": max(state_floors.values(), default=0.0),
        "metrics": max(metric_floors.values(), default=0.0),
        "gradient": max(grad_floors.values(), default=0.0),
    }
    problems = list(got.problems)
    blind = []  # where the gradient's tolerance is as large as the gradient
    for name, g in ref.gradient.items():
        largest = float(np.max(np.abs(g), initial=0.0))
        tol = gradient_tolerance(config, g, grad_floors[name])
        if tol is None:
            tol = atol_for(config, grad_floors[name]) + STRICT_RTOL * largest
        if largest <= tol:
            blind.append(name)
    names = ("loss", "gradient", "state", "metrics")
    deviations = {name: Deviation() for name in names}
    if got.run is not None:
        run, want = got.run, runs[0]
        for t, (a, b) in enumerate(zip(run.losses, want.losses, strict=True)):
            deviations["loss"].add(config, a, b, loss_floor, f"loss[{t}]")
        if run.gradient.keys() != ref.gradient.keys():
            problems.append(f"gradient paths differ: {sorted(run.gradient.keys() ^ ref.gradient.keys())}")
        for name in sorted(run.gradient.keys() & ref.gradient.keys()):
            g, floor = ref.gradient[name], grad_floors[name]
            tol = gradient_tolerance(config, g, floor)
            deviations["gradient"].add(config, run.gradient[name], g, floor, name, computed=False, tol=tol)
        if run.state.keys() != want.state.keys():
            problems.append(f"state paths differ: {sorted(run.state.keys() ^ want.state.keys())}")
        for name in sorted(run.state.keys() & want.state.keys()):
            state = run.state[name], want.state[name]
            deviations["state"].add(config, *state, state_floors[name], name, computed=False)
        for t, (mine, theirs) in enumerate(zip(run.metrics, want.metrics, strict=True)):
            if mine.keys() != theirs.keys():
                problems.append(f"metric names {sorted(mine)}, expected {sorted(theirs)}")
                continue
            for name in theirs:
                floor = metric_floors[name]
                deviations["metrics"].add(config, mine[name], theirs[name], floor, f"{name}[{t}]")
        problems += [f"{name} {p}" for name, d in deviations.items() for p in d.problems]
    return Result(config, problems, deviations, floors, got.census, got.gradients, blind=tuple(blind))


def check(config: Config) -> Result:
    """Train ``config`` both ways (the step under test and the reference) and hold one against the other."""
    start, cpu = time.perf_counter(), time.process_time()
    batches = batches_of(config)
    try:
        ref = kept_reference(config)
    except Exception as e:  # noqa: BLE001  (the fuzzer's own bug: reported with the draw, not fatal)
        problem = f"the reference raised {first_line(e)}"
        return Result(config, [problem], {}, {}, seconds=time.perf_counter() - start)
    result = compare(config, ref, device_run(config, batches))
    return dataclasses.replace(
        result, seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu
    )
