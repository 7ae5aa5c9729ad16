"""A character-level transformer language model, trained data-parallel on Python's own source.

    python examples/transformer_lm.py                                   # 8 emulated CPU devices
    python examples/transformer_lm.py --mode explicit --layout fsdp --microbatches 2
    python examples/transformer_lm.py --mesh data=4,model=2 --mode explicit --layout fsdp
    python -m substrax.launch -n 2 -d 4 examples/transformer_lm.py      # 2 processes x 4 devices
    python examples/transformer_lm.py --mesh stage=4,data=2 --blocks 4 --scan --schedule 1f1b --microbatches 8

The text is the standard library's top-level ``*.py`` files, which every Python install
has offline, read in sorted order, so every machine with the same Python version trains
on the same bytes. The model is a small decoder-only transformer (token and position
embeddings, 2 blocks of LayerNorm, causal multi-head attention and an MLP, d=64, 4
heads, 32-character context), trained with AdamW on batches of 32 windows. It prints the
layout of its state over the mesh, the loss and the throughput at intervals, and samples
a line of text at the end.

``--mode`` picks the implicit or explicit step, ``--layout`` how the state lies over the
data axis (replicated, ZeRO-1: optimizer state split, FSDP: parameters split too) and
``--microbatches`` how many accumulation steps each device's rows are split into; all
give the same losses to float32 round-off. ``--mesh stage=4,data=2`` with ``--scan``
pipelines the stacked blocks over 4 stages (``--blocks`` a multiple of them), each stage
its consecutive blocks, ``--schedule`` ``gpipe``, ``1f1b``, ``zb-h1`` or ``interleaved-1f1b``
(``--virtual-stages`` chunks a stage) over ``--microbatches``: the same losses again (see the
pipelines guide); a checkpoint resumes with or without a stage
axis. So do one process and several: every process
draws the same global batch and places only its own rows (``process_slice``); the step
is the same.

``--mesh`` lays the devices out on two axes, ``data`` and ``model`` (default: every
device on ``data``, and no ``model`` axis: the layers then compute as plain ones). The
model is built from ``substrax.nn``'s tensor-parallel layers, one definition for every
mesh: on ``--mesh data=4,model=2`` each attention layer's heads and each MLP's hidden
features are split over ``model`` (the MLP a column-parallel up projection, gelu, a
row-parallel down projection; the token and position tables by features; the output
layer whole), the batch is split over ``data`` only (both devices of a ``model`` pair
see the same rows), and ``--layout`` splits the state over ``data`` on another dimension
(the table printed at the start shows each array's splits). Each device then holds a
quarter of the batch and half of every split parameter; in the forward pass each
attention layer's and MLP's partial results are summed over ``model`` and the
embeddings' features gathered. The arithmetic is the same: the losses equal
``--mesh data=8``'s to float32 round-off (sums taken in another order), in both modes and every
layout; checkpoints restore across meshes. The heads (4) must divide by the ``model``
size. With ``--dropout`` the implicit step draws the same masks on every mesh; the
explicit step draws each ``data`` device's own, so its losses then depend on the
``data`` size (not on ``model``: both devices of a ``model`` pair draw the same mask).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import substrax
import substrax.launch
from substrax import checkpoint
from substrax.launch import process_slice
from substrax.mesh import create_device_mesh, use_cpu_devices
from substrax.nn import ColumnParallelLinear, ParallelEmbedding, ParallelSelfAttention, RowParallelLinear
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

VOCAB = 128  # ASCII; other bytes read as "?"
HEADS = 4
AXES = ("replica", "stage", "data", "model")  # the mesh axes --mesh may name (replica: hybrid sharding)


# --- the data: Python's standard library, as ASCII codes -----------------------------------


def stdlib_text() -> np.ndarray:
    """The top-level ``*.py`` files of the standard library, concatenated, as uint8 codes < 128.

    Files are taken in sorted order; private ones (``_*.py``, among them the
    machine-specific ``_sysconfigdata_*``) are left out.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    files = [f for f in files if not os.path.basename(f).startswith("_")]
    if not files:
        raise FileNotFoundError(f"no *.py files in the standard library directory {stdlib}")
    text = b"".join(Path(f).read_bytes() for f in files)
    codes = np.frombuffer(text, dtype=np.uint8).copy()
    codes[codes >= VOCAB] = ord("?")
    return codes


def batches(text: np.ndarray, batch: int, seq: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows of ``text``: tokens and the next character of each."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq + 1)
    while True:
        starts = rng.integers(0, len(text) - seq - 1, size=batch)
        windows = text[starts[:, None] + offsets].astype(np.int32)
        yield {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


def encode(s: str) -> np.ndarray:
    return np.frombuffer(s.encode("ascii", "replace"), dtype=np.uint8).astype(np.int32)


# --- the model ------------------------------------------------------------------------------


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each residual.

    Attention and MLP are ``substrax.nn`` layers: on a mesh with a ``model`` axis the
    heads and the MLP's hidden features are split over it; elsewhere they compute what
    ``nnx.Linear`` and plain attention compute.
    """

    def __init__(self, d: int, heads: int, dropout: float, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = ParallelSelfAttention(heads, d, causal=True, rngs=rngs)  # no dropout of its own
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = ColumnParallelLinear(d, 4 * d, rngs=rngs)  # hidden features split over model
        self.down = RowParallelLinear(4 * d, d, rngs=rngs)  # summed over model: whole again
        self.drop = nnx.Dropout(dropout, rngs=rngs if dropout else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.ln2(x)))))


class CharLM(nnx.Module):
    """Decoder-only character LM: ``(batch, seq)`` codes to ``(batch, seq, vocab)`` logits."""

    def __init__(
        self,
        *,
        vocab: int = VOCAB,
        seq: int = 32,
        d: int = 64,
        heads: int = HEADS,
        blocks: int = 2,
        dropout: float = 0.0,
        scan: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        self.seq = seq
        # The tables' features split over model, all-gathered after the lookup. (Split by
        # rows instead, the layout puts data on the features, against the batch's split
        # over data, and XLA's implicit step replicates a tensor to reshard it.)
        self.tok = ParallelEmbedding(vocab, d, split="features", rngs=rngs)
        self.pos = ParallelEmbedding(seq, d, split="features", rngs=rngs)
        self.scan = scan
        if scan:  # the Flax NNX idiom: one stacked Block (nnx.vmap), applied by nnx.scan (scan_layers)
            # (the layer axis gets its own, unsplit entry in each layer's declared split)
            @nnx.split_rngs(splits=blocks)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def stack(rngs: nnx.Rngs) -> Block:
                return Block(d, heads, dropout, rngs)

            self.blocks = stack(rngs)
        else:
            self.blocks = nnx.List([Block(d, heads, dropout, rngs) for _ in range(blocks)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)  # replicated over model: the loss sees every logit

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[-1]))
        if self.scan:  # nnx.scan over the layers (with --prefetch: the explicit step's own loop)
            x = substrax.nn.scan_layers(self.blocks, x)
        else:
            for block in self.blocks:  # causal: position i sees positions <= i
                x = block(x)
        return self.head(self.ln(x))


def loss_fn(model: CharLM, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-character cross-entropy (nats) over the batch's positions."""
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_model(
    seed: int = 0, dropout: float = 0.0, lr: float = 3e-3, **sizes: Any
) -> tuple[CharLM, nnx.Optimizer]:
    """The model and its AdamW optimizer; call under ``jax.set_mesh`` to place them on a mesh.

    ``sizes``: ``CharLM``'s ``seq``, ``d``, ``heads``, ``blocks``, ``scan`` (its defaults otherwise).
    """
    model = CharLM(dropout=dropout, rngs=nnx.Rngs(params=seed, dropout=seed + 1), **sizes)
    return model, nnx.Optimizer(model, optax.adamw(lr, weight_decay=0.01), wrt=nnx.Param)


def sample(model: CharLM, prompt: str, length: int, seed: int) -> str:
    """Continue ``prompt`` for up to ``length`` characters or to the end of the line (temperature 0.8)."""

    @nnx.jit
    def next_code(model: CharLM, window: np.ndarray, last: int, key: jax.Array) -> jax.Array:
        logits = model(jnp.asarray(window))[0, last]
        return jax.random.categorical(key, logits / 0.8)

    codes = list(encode(prompt))
    key = jax.random.key(seed)
    for _ in range(length):
        context = codes[-model.seq :]
        window = np.zeros((1, model.seq), np.int32)  # padded on the right: causal attention hides it
        window[0, : len(context)] = context
        key, sub = jax.random.split(key)
        code = next_code(model, window, len(context) - 1, sub)
        codes.append(int(code.addressable_data(0)))  # the same value on every process
        if codes[-1] == ord("\n"):
            break
    return bytes(codes).decode("ascii", "replace").rstrip("\n")


# --- the training loop ---------------------------------------------------------------------


class Progress:
    """A redrawn status line on a terminal; nothing between the interval lines otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.live = enabled and sys.stdout.isatty()

    def tick(self, step: int) -> None:
        if self.live:
            filled = 30 * step // self.total
            print(f"\r  [{'#' * filled}{'.' * (30 - filled)}] step {step}/{self.total}", end="", flush=True)

    def line(self, text: str) -> None:
        if self.live:
            print("\r\033[K", end="")  # clear the status line
        print(text, flush=True)


def parse_mesh(text: str) -> dict[str, int]:
    """``--mesh``'s value, ``data=4,model=2``, as ``{"data": 4, "model": 2}`` (argparse's ``type``)."""
    axes: dict[str, int] = {}
    for item in text.split(","):
        name, eq, size = (part.strip() for part in item.partition("="))
        if not eq or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} in {text!r} is not axis=size with a positive int size; "
                f"write it as data=4,model=2"
            )
        if name not in AXES:
            raise argparse.ArgumentTypeError(
                f"unknown mesh axis {name!r} in {text!r}; the axes are {', '.join(AXES)}"
            )
        if name in axes:
            raise argparse.ArgumentTypeError(f"mesh axis {name!r} is named twice in {text!r}")
        axes[name] = int(size)
    return axes


def mesh_shape(axes: dict[str, int], devices: int, batch: int, heads: int = HEADS) -> dict[str, int]:
    """``{"data": ..., "model": ...}`` for ``--mesh``'s axes on ``devices`` devices.

    ``data`` left out takes the devices ``replica``, ``stage`` and ``model`` leave; ``model`` left out
    is no ``model`` axis at all (the layers are then plain ones: their split over it is
    placed whole); ``replica`` (outer: hybrid sharding, ``--layout hsdp``) and ``stage`` (the
    pipeline's) likewise.

    Raises:
      ValueError: If the sizes' product is not ``devices``, ``model`` does not divide
        ``heads``, or the rows' devices do not divide ``batch``; says which.
    """
    model, replica, stage = axes.get("model", 1), axes.get("replica", 1), axes.get("stage", 1)
    others = model * replica * stage
    if "data" in axes:
        data = axes["data"]
    elif devices % others:
        extra = "".join(f" x {a}={axes[a]}" for a in ("replica", "stage") if a in axes)
        raise ValueError(f"--mesh model={model}{extra}: {others} does not divide the {devices} devices")
    else:
        data = devices // others
    shape = ({"replica": replica} if "replica" in axes else {}) | (
        {"stage": stage} if "stage" in axes else {}
    )
    shape |= {"data": data} | ({"model": model} if "model" in axes else {})
    if others * data != devices:
        given = ",".join(f"{k}={v}" for k, v in axes.items())
        sizes = " x ".join(str(n) for n in shape.values())
        raise ValueError(
            f"--mesh {given}: {sizes} = {others * data} devices, but there "
            f"are {devices}; the sizes' product must be the device count"
        )
    if heads % model:
        raise ValueError(
            f"--mesh model={model} does not divide the model's {heads} attention heads; "
            f"each model device runs whole heads (model size one of "
            f"{', '.join(str(n) for n in range(1, heads + 1) if heads % n == 0)})"
        )
    if batch % (data * replica):
        raise ValueError(
            f"--batch {batch} does not split over replica x data = {replica * data} devices; "
            "make it a multiple"
        )
    return shape


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=substrax.MODES, default="implicit")
    parser.add_argument(
        "--layout",
        choices=substrax.LAYOUTS,
        default="replicated",
        help="replicated state, ZeRO-1 (optimizer state split) or FSDP (parameters too)",
    )
    parser.add_argument(
        "--units",
        action="store_true",
        help="with --layout fsdp: each block an FSDP unit, gathered just in time (explicit mode)",
    )
    parser.add_argument(
        "--scan",
        action="store_true",
        help="the blocks stacked by nnx.vmap and applied by nnx.scan (with --units: gathered per layer)",
    )
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="with --units --scan: gather layer i+1 while layer i computes (explicit mode)",
    )
    parser.add_argument(
        "--microbatches", type=int, default=1, help="split each device's rows into K steps of accumulation"
    )
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks")
    parser.add_argument(
        "--schedule",
        choices=substrax.SCHEDULES,
        default=None,
        help="with a stage axis in --mesh and --scan: pipeline the blocks over it, over --microbatches",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        help="with --schedule interleaved-1f1b: the chunks of blocks each stage runs",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="global batch size, over all processes")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        help="emulated CPU devices (CPU only; ignored under substrax.launch and on accelerators)",
    )
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        default={},
        metavar="AXIS=SIZE,...",
        help="the device mesh over the axes data and model, as data=4,model=2 "
        "(default: every device on data); model splits the heads and the MLP",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--sample", type=int, default=80, help="characters to sample at the end (0: none)")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save the model and optimizer here (orbax), and resume from the latest step found there",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between checkpoints. A save waits for the one before it to be written: where that "
        "takes longer than the steps between (this small model on one TPU v5e: 0.5-0.6 s a save, 50 steps "
        "in 0.07 s), the loop runs at the disk's pace; the log line says the seconds spent saving apart "
        "from the steps' tokens/s",
    )
    parser.add_argument(
        "--precision",
        choices=("f32", "bf16"),
        default="f32",
        help="bf16: compute (and, in explicit mode, gather) in bfloat16; state and update stay float32",
    )
    return parser


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns every step's loss."""
    parser = make_parser()
    args = parser.parse_args(argv)
    substrax.launch.initialize()  # first: before anything touches a JAX backend
    if not jax.distributed.is_initialized():
        use_cpu_devices(args.devices)  # sets the CPU backend's device count; an accelerator ignores it
    try:
        shape = mesh_shape(args.mesh, jax.device_count(), args.batch)
    except ValueError as e:
        parser.error(str(e))  # exits 2, with the usage
    if ("stage" in shape) != (args.schedule is not None) or ("stage" in shape and not args.scan):
        parser.error(
            "a stage axis in --mesh pipelines the blocks: pass it with --scan and --schedule (and only so)"
        )

    mesh = create_device_mesh(shape)  # every device of every process, data x model
    sharding = create_data_parallel_sharding(mesh)  # rows split over data, whole on each model device
    with jax.set_mesh(mesh):
        # The same seed in every process: the same start. Under a mesh with a model axis
        # the tensor-parallel layers' parameters are placed split over it at creation.
        model, optimizer = make_model(args.seed, args.dropout, args.lr, scan=args.scan, blocks=args.blocks)
    # The layers' model-axis splits stay; the layout applies over data on another dimension:
    # replicated, ZeRO-1 (optimizer state split) or FSDP (parameters too).
    layout = substrax.shard_state(
        model,
        optimizer,
        mesh=mesh,
        layout=args.layout,
        units=Block if args.units else None,
        prefetch=args.prefetch,
        stages=Block if "stage" in shape else None,  # the pipeline's stages
        virtual_stages=args.virtual_stages,  # its chunks a stage (interleaved 1F1B)
    )
    per_device = f"{layout.bytes_per_device:,} of {layout.total_bytes:,} bytes per device"
    state_note = f"{args.layout} state ({per_device})"
    precision = substrax.MixedPrecision(jnp.bfloat16) if args.precision == "bf16" else None
    train_step = substrax.make_train_step(
        loss_fn,
        args.mode,
        mesh=mesh,
        microbatches=args.microbatches,
        precision=precision,
        schedule=args.schedule,
    )

    leader = jax.process_index() == 0
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    text = stdlib_text()
    tokens_per_step = args.batch * model.seq
    if leader:
        print(
            f"{params:,} parameters; {len(text):,} characters of Python {sys.version.split()[0]} stdlib; "
            f"{jax.process_count()} process(es), {jax.device_count()} {jax.default_backend()} devices "
            + (f"as replica={shape['replica']} x " if "replica" in shape else "as ")
            + (f"stage={shape['stage']} x " if "stage" in shape else "")
            + f"data={shape['data']} x model={shape.get('model', 1)}; {args.mode} step, {state_note}, "
            f"global batch {args.batch} x {model.seq}"
            + (f" in {args.microbatches} microbatches" if args.microbatches != 1 else "")
            + (f", {args.schedule} pipeline" if args.schedule else "")
            + (", bfloat16 compute" if precision is not None else ""),
            flush=True,
        )
        print(layout, flush=True)  # which array is split over which axis, on which dimension

    mine = process_slice(args.batch)
    data = batches(text, args.batch, model.seq, args.seed)
    ckpt = None
    first = 1
    if args.checkpoint_dir:  # every process saves and restores its own shards
        ckpt = checkpoint.CheckpointManager(
            os.path.abspath(args.checkpoint_dir), max_to_keep=2, save_interval_steps=args.checkpoint_every
        )
        if ckpt.latest_step() is not None:
            first = ckpt.restore(model, optimizer) + 1  # restored in the layout placed above
            for _ in range(first - 1):  # the batches those steps consumed
                next(data)
            if leader:
                print(f"resumed from step {first - 1} in {args.checkpoint_dir}", flush=True)
    progress = Progress(args.steps, enabled=leader)
    losses = []
    with train_step.bind(model, optimizer) as fast:
        start = mark = time.perf_counter()
        marked, saving = first - 1, 0.0  # saving: seconds spent in ckpt.save since the last line
        for step in range(first, args.steps + 1):
            batch = next(data)
            losses.append(fast(place_batch_on_shards({k: v[mine] for k, v in batch.items()}, sharding)))
            progress.tick(step)
            if step == first or step % args.log_every == 0 or step == args.steps:
                loss = float(losses[-1])  # waits for the step
                now = time.perf_counter()
                # the steps' rate: time spent saving is left out, and said apart
                rate = (step - marked) * tokens_per_step / (now - mark - saving)
                note = "  (includes compiling)" if step == first else ""
                note += f"  ({saving:.2f} s saving)" if saving else ""
                if leader:
                    progress.line(
                        f"step {step:>5}/{args.steps}  loss {loss:.6f}  {rate:>9,.0f} tokens/s  "
                        f"{now - start:6.1f} s{note}"
                    )
                mark, marked, saving = now, step, 0.0
            if ckpt is not None:
                began = time.perf_counter()
                ckpt.save(step, fast)  # every --checkpoint-every steps, written in the background
                saving += time.perf_counter() - began
    # model and optimizer hold the trained state again here
    skipped = [first + i for i, x in enumerate(losses) if not np.isfinite(float(x))]
    if skipped and leader:  # the step skips a non-finite update (skip_nonfinite=True) and says so by its loss
        print(
            f"{len(skipped)} step(s) had a non-finite loss and left the model unchanged: {skipped}",
            flush=True,
        )
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()

    if args.sample:
        model.eval()  # no dropout
        line = sample(model, "def ", args.sample, args.seed)
        if leader:
            print(f"sample: {line}", flush=True)
    return [float(x) for x in losses]


if __name__ == "__main__":
    main()
