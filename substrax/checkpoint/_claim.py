"""The claim of a run on its checkpoint directory, the file ``substrax.lock`` (see the checkpoints guide)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import socket
import sys
import time
import uuid
import warnings
from typing import Any

from substrax.checkpoint._errors import DirectoryInUseError
from substrax.launch import launch_env

__all__ = ["LOCK_FILE", "claim_directory", "release_claim"]


LOCK_FILE = "substrax.lock"  # a run's claim on its checkpoint directory


def _process_state(pid: int) -> tuple[bool, int | None] | None:
    """``(alive, start)`` of ``pid`` here (not alive: a zombie; start: ticks after boot), or None."""
    if os.path.exists("/proc/self/stat"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return fields[0] not in ("Z", "X"), int(fields[19])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, IndexError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return True, None


def _run_identity() -> str:
    """The run this process belongs to, as each of its processes names it."""
    with contextlib.suppress(RuntimeError):
        env = launch_env()
        if env is not None:
            return (
                f"substrax.launch run of {env.num_processes} processes, launcher pid "
                f"{env.launcher_pid}, coordinator {env.coordinator_address}"
            )
    if "SLURM_JOB_ID" in os.environ:
        return f"SLURM job {os.environ['SLURM_JOB_ID']}"
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        return f"jax.distributed run, coordinator {os.environ['JAX_COORDINATOR_ADDRESS']}"
    return f"process {os.getpid()} on {socket.gethostname()}"


def _new_claim() -> dict[str, Any]:
    pid = os.getpid()
    state = _process_state(pid)
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "started": state[1] if state else None,
        "run": _run_identity(),
        "command": shlex.join(sys.argv)[:300],
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "token": uuid.uuid4().hex,
    }


def _read_claim(path: str) -> dict[str, Any] | None:
    """The claim in the file ``path``: ``None`` when there is none, ``{}`` when it cannot be read."""
    for _ in range(20):
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        if text:
            try:
                claim = json.loads(text)
            except ValueError:
                return {}
            return claim if isinstance(claim, dict) else {}
        time.sleep(0.05)  # created an instant ago, not yet written
    return {}


def _write_claim(path: str, claim: dict[str, Any]) -> bool:
    """Create ``path`` holding ``claim``; ``False`` if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(claim))
        f.flush()
        os.fsync(f.fileno())
    return True


def _is_stale(claim: dict[str, Any]) -> bool:
    """Whether ``claim`` was made by a process of this host that is gone."""
    if claim.get("host") != socket.gethostname() or not isinstance(claim.get("pid"), int):
        return False
    state = _process_state(claim["pid"])
    if state is None or not state[0]:
        return True
    started = claim.get("started")
    return started is not None and state[1] is not None and started != state[1]


def _owner(claim: dict[str, Any]) -> str:
    return (
        f"pid {claim.get('pid')} on {claim.get('host')} since {claim.get('since')} "
        f"({claim.get('run')}: {claim.get('command')})"
    )


def _in_use(directory: str, path: str, claim: dict[str, Any]) -> str:
    if not claim:
        return (
            f"{directory} is claimed by a run whose claim {path} cannot be read; if no run "
            f"uses the directory, delete that file."
        )
    if claim.get("host") == socket.gethostname() and claim.get("pid") == os.getpid():
        return (
            f"{directory} is already open in this process (since {claim.get('since')}): a "
            f"checkpoint directory belongs to one CheckpointManager at a time; close the other first."
        )
    return (
        f"{directory} is in use by another run: {_owner(claim)}. A checkpoint directory "
        f"belongs to one run at a time: wait for that run to end, or give this one another "
        f"directory; if that run is gone (its host lost), delete {path}."
    )


def claim_directory(directory: str) -> dict[str, Any]:
    """Claim ``directory`` for this process: take the lock file, or a stale one (with a warning).

    Raises:
      DirectoryInUseError: If a live process holds it, or one on another host.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    mine = _new_claim()
    for _ in range(10):
        if _write_claim(path, mine):
            return mine
        held = _read_claim(path)
        if held is None:
            continue  # released meanwhile
        if not held or not _is_stale(held):
            raise DirectoryInUseError(_in_use(directory, path, held))
        aside = f"{path}.stale-{mine['token']}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        moved = _read_claim(aside)
        if moved and moved.get("token") != held.get("token"):
            with contextlib.suppress(OSError):
                os.link(aside, path)  # a live claim made since we read: put it back
        else:
            warnings.warn(
                f"took over {directory} from a run that is gone: {_owner(held)}; that process "
                f"no longer runs.",
                stacklevel=4,
            )
        with contextlib.suppress(OSError):
            os.unlink(aside)
    raise DirectoryInUseError(f"could not claim {directory}: its claim file {path} kept changing.")


def release_claim(path: str | None, token: str | None) -> None:
    """Delete the claim file ``path`` if it still holds the claim ``token``."""
    if path is None:
        return
    held = _read_claim(path)
    if held and held.get("token") == token:
        with contextlib.suppress(OSError):
            os.unlink(path)
