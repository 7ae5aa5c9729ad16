"""The parity fuzzer: both modes, every layout, against an independent one-device reference.

Hypothesis draws a ``Config`` (``fuzz_space.py``: model blocks, optimizer, layout, mode,
microbatches, devices, batch tree, metrics, spelling, mixed-precision policy) and
``check(config)`` trains it for a few steps with ``substrax.make_train_step`` and, separately,
with a plain one-device reference (``nnx.value_and_grad`` and ``optimizer.update`` under
``nnx.jit``, no mesh; under a precision policy, the same casts: below). It checks:

- the losses, the metrics (every reduction) and the model's state (parameters and BatchNorm
  statistics) against the reference;
- that the layout is kept (``substrax.layout_of`` and every array's sharding, before == after);
- that the step's census matches its layout's rule (``step.check_communication(...).matches``,
  first named ``step.census``), on the draws that use the plain call (the bound step compiles
  the same program with donated buffers; its census would compile it once more). In explicit
  mode it must match. In implicit mode XLA's partitioner chooses, and with a few rows per
  device it may gather the batch and compute a gradient on every device instead of reducing
  it (found by this fuzzer: ``test_regression_implicit_xla_gathers_a_tiny_batch``); such a
  draw prints ``census xla-chose`` and does not fail;
- ``compare_gradients`` on the trained model, on the draws that ask for it (three more
  compiles) and where it applies (no BatchNorm: below).

What the reference computes, and why (the documented semantics, not bugs):

- **A model without BatchNorm**: the plain reference, one ``nnx.value_and_grad`` of the loss
  on the whole global batch. Microbatches, devices and layouts must not change the result.
- **BatchNorm** normalizes with the statistics of the rows it sees, so the reference sees the
  same groups of rows the step does. With ``microbatches=k`` both modes normalize each
  microbatch on its own, microbatch j being every device's j-th slice of its rows; the
  reference differentiates the mean of the k microbatch losses, one after the other (the
  running statistics updated k times). BatchNorm with ``axis_name="data"`` (explicit mode;
  built without it in implicit mode and in the reference) uses the statistics of the whole
  (micro)batch. BatchNorm *without* ``axis_name`` in **explicit** mode uses each device's shard:
  there the reference ``jax.vmap``s the loss over the devices' shards (``axis_name="data"``,
  so a synchronized BatchNorm in the same model still sees all of them), and averages the
  shards' running statistics, as the step does after it. In implicit mode it sees the global
  (micro)batch. ``compare_gradients`` has no such grouping (its explicit path always normalizes
  per shard, and its reference has no axis to bind): it is skipped for BatchNorm models.
- **Dropout** is off in every draw (rate 0, or ``deterministic=True`` on the dropout layers
  only): active dropout draws different masks in the two modes.
- **Metrics** reduced by ``None`` come back unreduced: the global value in implicit mode
  (with microbatches, one per microbatch), per device in explicit mode (with microbatches,
  per device and microbatch). The reference's per-example losses give each shape.

**Precision draws** (a third of them): the step runs under ``substrax.MixedPrecision(bfloat16,
reduce_dtype=float32 or bfloat16)``, and the reference applies the same policy on one device,
written out (``_low_precision_value_and_grad``): the loss of the parameters and the floating
batch leaves cast to bfloat16, differentiated with respect to the float32 parameters through
the cast, the loss and per-example losses in float32, the gradient rounded to ``reduce_dtype``,
the update in float32. Its split runs (below) round as the step does: a gradient per device and
microbatch in bfloat16, added one after another in ``reduce_dtype``
(``_sliced_low_precision_value_and_grad``). The draw also checks that the loss and the metrics
come back float32 and that the parameters and the optimizer state are float32 after training
(every draw does); the census is the step's own, which takes the policy (explicit mode expects
gathers in ``param_dtype`` and reductions in ``reduce_dtype``, widened to float32 on CPU);
``compare_gradients`` runs under the policy.

Tolerances come from a noise floor measured in every draw: the reference is run again on
``FLOOR_RUNS`` row-permuted batches (rows permuted only within the groups a BatchNorm
normalizes together, so each permuted run is just as valid; the loss is a row mean, invariant
to the order), which sums every batch reduction in another order, and twice more "split": the
same loss computed slice by slice, one slice per device and microbatch as the step cuts the
batch (partial sums added one after the other; with BatchNorm, the slices vmapped over an axis
the statistics are reduced over), which rounds like the step's own partial sums and smaller
matrix products. The floor of a quantity is the largest deviation between any two of those
runs (the reference included), per state leaf, per metric and over the losses.

Under the SGD family a value must be within ``atol 1e-6 + rtol 1e-5``; under the Adam family
(adaptive steps turn a near-zero gradient element's round-off into a visible difference: an
attention key bias, a bias before BatchNorm) within ``max(1e-6, 4 x floor + 1e-7) + rtol
1e-5``. The SGD family is held to the floor rule too where the floor itself is above 1e-6:
BatchNorm over 2-4 rows divides by the square root of a variance that can be tiny, which
amplifies round-off in any implementation (a failing line shows the floor next to the
deviation). A precision draw measures its floor over more split runs (``BF16_SPLIT_RUNS``, on
rows permuted across the slices: in bfloat16 a permutation within a slice rarely changes a
bit) and holds every value to the floor rule, the loss and the metrics with ``rtol BF16_RTOL``
(one bfloat16 unit in the last place) instead of 1e-5; the measurements are at the constants.

**The first step's gradient** (every draw): the optimizer's first transformation
(``fuzz_space.first_gradient``) keeps the gradient it is handed at the first step, before
Adam divides it by its own magnitude, and that gradient is held to the reference's, per
parameter. A tolerance on the parameters after Adam's steps measures what round-off does to
them, and at a leaf where that is a step's worth it cannot see the gradient zeroed or negated
(bfloat16 + BatchNorm + Adam, seed 72: ``blocks/2/scale``'s tolerance 2e-2, its gradient
zeroed 0.48x of it, negated 0.74x). Float32 draws hold the gradient to the floor rule, its
floor measured over the same runs. A precision draw holds it to the float32 one-device
gradient (the same groups of rows, no policy), within ``BF16_GRADIENT_ROUNDINGS x u x
max|g|`` (u = 2**-8, bfloat16's unit round-off; ``max|g|`` the leaf's largest float32
element) plus ``SAFETY x`` its floor, the largest deviation of a bfloat16 reference run from
float32. The first term bounds the rounding of the products and partial sums a gradient
element adds up, each at most u relative, where they do not cancel; the second what
bfloat16 does where they do: a bias before BatchNorm has a float32 gradient of 5e-9 and a
bfloat16 one of 6e-4, the round-off of the terms that cancel. The parameters of a precision
draw are held to their floor as before. A leaf's zeroed gradient fails the check where its
tolerance is below ``max|g|``: ``test_the_check_fails_when_any_leafs_gradient_is_zeroed_or_negated``
zeroes and negates each leaf of two draws (a leaf whose gradient is zero but for round-off
excepted: there the mutation changes nothing a check could see). A draw's line lists the
leaves whose tolerance is at least their gradient as ``blind``: zero but for round-off (an
attention key bias, a bias or scale before BatchNorm: every one in a sample of 36 draws),
or one whose bfloat16 round-off is as large as it (measured: a scanned layer's bias summing
4 rows of a classification, bfloat16 runs 0.13-0.44 x its size off float32).

``make test`` runs a fixed-seed sample (``SUBSTRAX_FUZZ`` unset: profile ``fuzz-ci``);
``make fuzz`` (``SUBSTRAX_FUZZ=full``) a few hundred random draws (``SUBSTRAX_FUZZ_EXAMPLES``),
printing one line per draw. Every failing draw is listed at the end with its ``Config`` as
Python code: ``check(Config(...)).assert_ok()`` is its regression test.
``SUBSTRAX_FUZZ_PIN="scan='prefetch',units='stack',layout='fsdp'"`` holds those fields of
every draw (Python literals), to search one corner of the space.

The fuzzer's parts beside this file: ``fuzz_space.py`` (what is drawn), ``fuzz_reference.py``
(the one-device reference runs), ``fuzz_device.py`` (the step under test) and ``fuzz_check.py``
(the tolerances, the comparison, ``check``).
"""

from __future__ import annotations

import ast
import dataclasses
import os

import numpy as np
import pytest
from fuzz_check import Result, batches_of, check, compare, kept_reference, maxdiff
from fuzz_device import device_run
from fuzz_reference import reference_runs
from fuzz_space import MIN_BATCHNORM_ROWS, Config, configs, measurable
from hypothesis import HealthCheck, example, given, settings

settings.register_profile(
    "fuzz-ci",
    # 4 drawn configurations (CURATED run as tests of their own): there were 6 before the precision axis,
    # which changed which ones are drawn; 6 of the new draws took 48 of the sample's 86 cpu-s, 4 keep it
    # near 70
    max_examples=4,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz-full",
    max_examples=int(os.environ.get("SUBSTRAX_FUZZ_EXAMPLES", "300")),
    derandomize=False,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = "fuzz-full" if os.environ.get("SUBSTRAX_FUZZ") == "full" else "fuzz-ci"

# ----------------------------------------------------------------------------------------- the fuzzer


# Run first in every profile, before the drawn ones: the core cases and the neighbourhoods of
# the bugs found so far, so that the fixed sample of `make test` always covers them.
CURATED = (
    # explicit FSDP, 8 devices, Adam, microbatches, every metric reduction
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=8,
        microbatches=2,
        blocks=("linear", "layernorm"),
        width=16,
        optimizer="adam",
        batch_tree="nested",
        mask=True,
        scale=True,
        metrics=("mean", "sum", "max", "min", "gather", None, "default"),
        seed=1,
    ),
    # implicit ZeRO-1, attention and BatchNorm, masked classification, a placed batch
    Config(
        mode="implicit",
        layout="zero1",
        min_size=1,
        devices=4,
        stem="attention",
        blocks=("batchnorm",),
        task="classify",
        optimizer="adamw_masked",
        batch_tree="tuple",
        mask=True,
        scale=True,
        placement="placed",
        metrics=("gather", "max"),
        seed=2,
    ),
    # explicit, synchronized and per-shard BatchNorm on a conv stem, the bound spelling
    Config(
        mode="explicit",
        layout="replicated",
        devices=4,
        rows=3,
        stem="conv",
        blocks=("batchnorm_sync", "batchnorm"),
        optimizer="momentum",
        spelling="bind",
        seed=3,
    ),
    # a whole-gradient optimizer on split state
    Config(mode="explicit", layout="zero1", min_size=1, devices=8, optimizer="clip_sgd", width=16, seed=4),
    # explicit microbatches with per-shard BatchNorm (3 rows: measurable)
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=2,
        microbatches=2,
        rows=3,
        blocks=("batchnorm",),
        optimizer="sgd",
        seed=5,
    ),
    # factored optimizer state
    Config(mode="implicit", layout="fsdp", min_size=1, devices=2, optimizer="adafactor", width=16, seed=6),
    # masked optimizer state (optax.MaskedNode, #26.1): muon under explicit FSDP, bound
    Config(mode="explicit", layout="fsdp", min_size=1, devices=8, optimizer="muon", spelling="bind", seed=8),
    # FSDP units (#27): each block a unit, kept from the forward pass, BatchNorm inside, microbatches
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=4,
        microbatches=2,
        blocks=("linear", "batchnorm_sync", "dropout_zero"),
        width=16,
        optimizer="adam",
        units="blocks",
        reshard=False,
        seed=9,
    ),
    # a scanned stack under remat, its block the unit (#27.4): gathered one layer at a time in the loop
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=8,
        units="stack",
        scan="remat",
        optimizer="adam",
        seed=11,
    ),
    # the scanned stack a unit with prefetch (#27.4): the library's loop, a layer gathered ahead, bfloat16
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=4,
        microbatches=2,
        units="stack",
        scan="prefetch",
        precision="bf16/f32",
        optimizer="adam",
        seed=13,
    ),  # fmt: skip
    # hybrid sharding (#28): FSDP within each of 2 replicas, units, microbatches, synchronized BatchNorm
    Config(
        mode="explicit",
        layout="hsdp",
        min_size=1,
        devices=8,
        microbatches=2,
        blocks=("linear", "batchnorm_sync"),
        units="blocks",
        optimizer="adam",
        seed=12,
    ),  # fmt: skip
    # the plain call while the caller holds the state (a save in flight): a copy donated, one program
    Config(mode="implicit", layout="fsdp", min_size=1, devices=4, optimizer="adam", spelling="held", seed=14),
    # found by make fuzz: HSDP on (replica=2, data=1) compiled 2 programs (state placed over the size-1
    # axis, written without it); a held dropout key has no host form (the check raised)
    Config(mode="explicit", layout="hsdp", min_size=1, devices=2, spelling="held", seed=15),
    Config(mode="explicit", layout="zero1", stem="conv", blocks=("dropout_eval",), spelling="held", seed=16),
    # every Linear a unit (stem, blocks, head), gathered again for the backward pass
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=8,
        blocks=("linear", "linear"),
        units="linear",
        seed=10,
    ),
    # bfloat16 gathers, reductions and microbatch sums: explicit FSDP under MixedPrecision(bf16, bf16)
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=4,
        microbatches=2,
        optimizer="adam",
        precision="bf16/bf16",
        seed=7,
    ),
)


@pytest.mark.parametrize("config", CURATED, ids=str)
def test_curated_configs(config: Config) -> None:
    """The corners of the space (``CURATED``), each its own test, in ``make test``."""
    result = check(config)
    assert result.ok, result.report()


def test_every_curated_batchnorm_group_has_rows_enough_to_measure_its_floor() -> None:
    assert all(c == measurable(c) for c in CURATED)


def test_regression_a_two_row_batchnorm_group_is_not_drawn() -> None:
    """Found by the curated draw below at rows=2 (jax 0.12.0.1): explicit per-shard BatchNorm on
    two rows per device ended 18x its tolerance off the reference, 100x its floor, and within
    tolerance at 3 rows or with exact variance; two rows have one summation order, so the floor
    could not see the cancellation in flax's fast variance (``fuzz_space.measurable``)."""
    found = Config(
        mode="explicit", layout="fsdp", min_size=1, devices=2, microbatches=2, blocks=("batchnorm",), seed=5
    )
    assert found.batchnorm_rows == 2
    assert measurable(found).batchnorm_rows == MIN_BATCHNORM_ROWS
    assert measurable(dataclasses.replace(found, mode="implicit")).rows == 2  # 4 rows together already
    drawn = []
    # hypothesis's defaults here would be random draws, an on-disk database and the too_slow
    # health check on generation time (which a loaded machine can fail): fixed draws, no clock
    quiet = settings(
        max_examples=100,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    quiet(given(configs())(lambda c: drawn.append(c)))()
    assert all((c.batchnorm_rows or MIN_BATCHNORM_ROWS) >= MIN_BATCHNORM_ROWS for c in drawn)
    assert any(c.batchnorm for c in drawn)


def pinned(config: Config, pins: str | None = None) -> Config:
    """``config`` with the fields ``pins`` (default ``$SUBSTRAX_FUZZ_PIN``) names set:
    ``"field=literal,..."``, each value a Python literal."""
    pins = os.environ.get("SUBSTRAX_FUZZ_PIN", "") if pins is None else pins
    fields = {f.name for f in dataclasses.fields(Config)}
    values = {}
    for pin in filter(None, (p.strip() for p in pins.split(","))):
        name, _, literal = pin.partition("=")
        if name.strip() not in fields:
            raise ValueError(
                f"SUBSTRAX_FUZZ_PIN: {name.strip()!r} is not a Config field; one of {sorted(fields)}."
            )
        values[name.strip()] = ast.literal_eval(literal.strip())
    return dataclasses.replace(config, **values)


def test_a_pin_holds_named_fields_and_refuses_an_unknown_one() -> None:
    config = pinned(Config(), "scan='prefetch', units='stack', microbatches=2")
    assert (config.scan, config.units, config.microbatches, config.layout) == (
        "prefetch",
        "stack",
        2,
        "replicated",
    )
    with pytest.raises(ValueError, match="'units_' is not a Config field"):
        pinned(Config(), "units_='stack'")


@pytest.mark.slow  # make test-slow (in .ci/run); make fuzz draws more
def test_parity_fuzz() -> None:
    """Draws (profile ``fuzz-ci``, or ``fuzz-full`` with ``SUBSTRAX_FUZZ=full``, the
    ``CURATED`` configurations first); every draw is checked and printed, the failing ones
    listed at the end."""
    results: list[Result] = []

    def draw(config: Config) -> None:
        result = check(config)
        results.append(result)
        print(f"#{len(results):<3} {result.line()}", flush=True)

    run = given(configs().map(pinned))(draw)
    if PROFILE == "fuzz-full":
        for config in reversed(CURATED):
            run = example(config)(run)
    settings(settings.get_profile(PROFILE))(run)()

    failed = [r for r in results if not r.ok]
    floors: dict[tuple[str, str], float] = {}
    for r in results:
        family = ("adam" if r.config.adaptive else "sgd") + ("" if r.config.precision is None else "+bf16")
        for k, v in r.floors.items():
            floors[(family, k)] = max(floors.get((family, k), 0.0), v)
    print(
        f"\n{len(results)} draws ({sum(r.cpu_seconds for r in results):.0f} cpu-s), "
        f"{sum(r.config.precision is not None for r in results)} with a precision policy, "
        f"{len(failed)} failed, "
        f"{sum(r.census == 'xla-chose' for r in results)} implicit census mismatches shown, "
        f"{sum(len(r.blind) for r in results)} leaves in {sum(bool(r.blind) for r in results)} draws blind "
        "to a zeroed gradient (shown); largest floors: "
        + ", ".join(f"{f}/{k} {v:.1e}" for (f, k), v in sorted(floors.items())),
        flush=True,
    )
    assert not failed, f"{len(failed)} of {len(results)} draws failed:\n\n" + "\n\n".join(
        r.report() for r in failed
    )


def test_regression_implicit_xla_gathers_a_tiny_batch() -> None:
    """Found by the fuzzer: implicit ZeRO-1, 4 devices, 2 rows each, an embedding stem.

    XLA all-gathers the batch's mask (``pred[8]``) and computes the embedding's and the
    value kernel's gradients on every device instead of reduce-scattering them. The values
    are right; the census names exactly the buffers XLA chose not to reduce.
    """
    config = Config(
        mode="implicit", layout="zero1", min_size=1, devices=4, microbatches=1, rows=2,
        stem="attention", blocks=("batchnorm",), width=8, task="classify",
        optimizer="adamw_masked", batch_tree="tuple", mask=True, scale=True, placement="placed",
        metrics=("gather", "max"), spelling="call", compare_gradients=False, seed=2, steps=3,
    )  # fmt: skip
    result = check(config)
    result.assert_ok()  # losses, state and metrics to the floor; the layout kept
    assert result.census == "xla-chose"


SEED_72 = Config(
    mode="explicit", layout="hsdp", min_size=None, devices=2, microbatches=2, rows=3, stem="conv",
    blocks=("dropout_zero", "batchnorm", "batchnorm"), width=16, task="classify", optimizer="adam",
    batch_tree="nested", scale=True, placement="batch_spec", metrics=("mean", "gather", None, "max"),
    precision="bf16/bf16", scan="scan", seed=72, steps=3,
)  # fmt: skip


def test_regression_bf16_gradients_added_device_by_device() -> None:
    """Found by ``make fuzz`` (2026-12-06): explicit HSDP, bfloat16 gradients (``bf16/bf16``), 2
    devices x 2 microbatches, per-shard BatchNorm, Adam. ``blocks/2/scale`` ended 32x its
    tolerance off the reference. One element of its first gradient is 3.5e-5 exactly, the sum
    of four parts' bfloat16 gradients near 1e-3 (one unit in the last place: 7.6e-6): the step,
    which adds each device's microbatches first, got -1.5e-5, every split run of the floor,
    which added microbatch by microbatch, +7.6e-6, and Adam made the two signs a whole step
    apart. Rounding, not a wrong sum: split runs that add device by device
    (``by_device=True``) give the step's bits. The floor now has split runs in both orders."""
    config = SEED_72
    batches = batches_of(config)
    by_microbatch, by_device = (
        reference_runs(config, batches, [None], split=True, by_device=d)[0].state["blocks/2/scale"]
        for d in (False, True)
    )
    assert maxdiff(by_microbatch, by_device) > 1e-2  # the order alone: about two Adam steps of 1e-2
    check(config).assert_ok()


@pytest.mark.parametrize("microbatches", [1, 2])
def test_regression_one_device_census_attributes_batchnorms_own_psum(microbatches: int) -> None:
    """Found by the fuzzer: explicit mode on 1 device, BatchNorm with ``axis_name``. The
    layer's own psum over the size-1 axis was reported as an unexpected all-reduce (or one
    inside the microbatch loop); it is the model's, and is attributed to it."""
    config = Config(
        mode="explicit", layout="fsdp", min_size=1, devices=1, microbatches=microbatches, rows=3,
        stem="attention", blocks=("batchnorm_sync", "dropout_zero", "dropout_eval"), width=8,
        optimizer="adafactor", batch_tree="nested", scale=True, placement="placed", seed=2005,
    )  # fmt: skip
    result = check(config)
    result.assert_ok()
    assert result.census == "ok"


# A leaf whose float32 gradient is below this fraction of the largest leaf's is zero but for
# round-off: a check may be blind to it zeroed or negated (its bfloat16 round-off is larger).
ROUND_OFF = 1e-5


@pytest.mark.parametrize(
    ("config", "blind"),
    [
        # BatchNorm normalizes away a shift of what it reads: the conv stem's bias (before the
        # first BatchNorm) and the first BatchNorm's bias (before the second) have a gradient
        # of zero but for round-off (5e-9, 9e-9), bfloat16's round-off of it 6e-4 and 1e-8
        (SEED_72, {"stem/bias", "blocks/1/bias"}),
        (CURATED[0], set()),  # float32, explicit FSDP, Adam, microbatches, Linear and LayerNorm
    ],
    ids=["bf16-batchnorm-adam-seed72", "f32-fsdp-adam"],
)
def test_the_check_fails_when_any_leafs_gradient_is_zeroed_or_negated(config: Config, blind: set) -> None:
    """The mutation test: the step under test with one parameter's gradient multiplied by 0 or
    -1 in every step (``fuzz_space.mutate``: the optimizer's first transformation) fails
    ``check``'s comparison on that leaf's first gradient, for every leaf the check does not
    report blind, and those are zero but for round-off; unmutated, the same program passes."""
    ref, batches = kept_reference(config), batches_of(config)
    result = compare(config, ref, device_run(config, batches, mutation=(next(iter(ref.gradient)), 1.0)))
    result.assert_ok()
    assert set(result.blind) == blind
    top = max(float(np.max(np.abs(g))) for g in ref.gradient.values())
    assert all(np.max(np.abs(ref.gradient[leaf])) < ROUND_OFF * top for leaf in blind)
    for leaf in sorted(set(ref.gradient) - blind):
        for factor in (0.0, -1.0):
            result = compare(config, ref, device_run(config, batches, mutation=(leaf, factor)))
            assert result.deviations["gradient"].where == leaf, (leaf, factor, result.report())
            assert any(p.startswith(f"gradient off the reference: worst {leaf},") for p in result.problems), (
                leaf, factor, result.report(),
            )  # fmt: skip
