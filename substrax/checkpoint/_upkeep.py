"""What a ``CheckpointManager`` holds, keeps and lets go: claim, SIGTERM, trash, skipped steps, exit."""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import threading
import uuid
import warnings
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from substrax.checkpoint._checksums import everywhere
from substrax.checkpoint._claim import LOCK_FILE, claim_directory, release_claim
from substrax.checkpoint._errors import DamagedCheckpointError, DirectoryInUseError
from substrax.checkpoint._integrity import PACKAGE_DIR, STEP_METADATA, reason
from substrax.checkpoint._preemption import SIGTERM_EXIT, Sigterm, jax_preemption_service
from substrax.checkpoint._quiet import orbax_logs

__all__ = ["ManagerUpkeep"]

_TRASH = ".substrax-trash"  # where orbax moves a step rotated out; the manager deletes it from there
_DAMAGED = ".substrax-damaged"  # where a writing manager moves the damaged steps a restore skipped


def _let_go(lock: str | None, token: str | None, listening: bool) -> None:
    """Release a manager's claim and stop it listening for SIGTERM (at close, or when collected)."""
    try:
        release_claim(lock, token)
    finally:
        if listening:
            Sigterm.stop()


def _remove_trash(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(f"{_TRASH}-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


class ManagerUpkeep:
    """The claim, SIGTERM, the steps' retention and the exit handling of a ``CheckpointManager``."""

    # set by CheckpointManager.__init__ (and _hold, _open_orbax)
    directory: str
    read_only: bool
    orbax: Any
    _local: bool
    _primary: bool
    _closed: bool
    _sweeper: threading.Thread | None
    _agree_on_sigterm: bool
    _listening: bool
    _release: weakref.finalize[Any, Any]
    _kept: tuple[int, list[dict[str, Any]]] | None
    _repeated: int | None

    if TYPE_CHECKING:

        def wait(self) -> None: ...
        def close(self) -> None: ...

    def _hold(self, save_on_sigterm: bool) -> None:
        """Claim the directory (a local one, unless read-only) and listen for SIGTERM, as asked."""
        lock = os.path.join(self.directory, LOCK_FILE) if self._local and not self.read_only else None
        claim = self._claim() if lock is not None else None
        # Several processes agree on SIGTERM themselves when JAX's preemption service is off
        # (as substrax.launch turns it off): each save asks whether any process got one.
        self._agree_on_sigterm = (
            save_on_sigterm
            and not self.read_only
            and jax.process_count() > 1
            and not jax_preemption_service()
        )
        try:
            self._listening = (
                save_on_sigterm
                and not self.read_only
                and (jax.process_count() == 1 or self._agree_on_sigterm)
                and Sigterm.listen()
            )
        except BaseException:
            release_claim(lock, claim["token"] if claim else None)
            raise
        self._release = weakref.finalize(
            self, _let_go, lock if claim else None, claim["token"] if claim else None, self._listening
        )

    def _open_orbax(self, max_to_keep: int | None, save_interval_steps: int, async_save: bool) -> None:
        """``self.orbax``: orbax's manager of the directory (the claim let go if it fails)."""
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=not self.read_only,
            todelete_subdir=_TRASH if self._local and not self.read_only else None,
        )
        try:
            with orbax_logs() as logs:  # a step's damaged metadata: restore says it in one line
                self.orbax = ocp.CheckpointManager(
                    self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
                )
                logs.release(keep=lambda record: STEP_METADATA not in record.getMessage())
        except BaseException:
            self._release()
            raise

    def _claim(self) -> dict[str, Any] | None:
        """Process 0 claims the directory; every process learns whether it could."""
        claim: dict[str, Any] | None = None
        error: Exception | None = None
        if self._primary:
            try:
                claim = claim_directory(self.directory)
            except Exception as e:  # noqa: BLE001  (raised below, once every process knows)
                error = e
        if jax.process_count() > 1:
            refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
            if refused and error is None:
                error = DirectoryInUseError(
                    f"{self.directory} is in use by another run: process 0 could not claim it (see its "
                    f"error)."
                )
        if error is not None:
            raise error
        return claim

    def _repeats(self, step: int, arrays: list[dict[str, Any]]) -> int | None:
        """The kept step whose state ``arrays`` (a checksum record) repeats, warning at the first of a run."""
        if self._kept is None or self._kept[1] != arrays or self._kept[0] not in self.orbax.all_steps():
            return None
        kept = self._kept[0]
        if self._repeated != kept and kept != step:
            self._repeated = kept
            warnings.warn(
                f"step {step} not saved in {self.directory}: its state is step {kept}'s, unchanged "
                f"since (the train step skips non-finite updates, leaving the state as it was); "
                f"step {kept} is kept and no step is rotated out, and later saves of this same "
                f"state are skipped without a word.",
                skip_file_prefixes=(PACKAGE_DIR,),
            )
        return kept

    def _termination_notice(self, step: int) -> bool:
        """Whether this run was told to stop: a SIGTERM noted, or JAX's preemption sync point."""
        if self._agree_on_sigterm:  # a SIGTERM to any process stops them all at this step
            return not everywhere(not (self._listening and Sigterm.pending))
        if self._listening:
            return Sigterm.pending
        if jax.process_count() > 1:
            return bool(self.orbax.reached_preemption(step))
        return False

    def _non_finite(self, step: int, names: list[str]) -> str:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        failed = ""
        try:
            self.orbax.wait_until_finished()  # a save in flight commits: the step named is kept
        except Exception as e:  # noqa: BLE001  (said in the message, which matters more)
            failed = f" (the save in flight failed: {reason(e)})"
        latest = self.latest_step()
        kept = f"the newest step kept there is {latest}" if latest is not None else "it holds no step yet"
        return (
            f"step {step} not saved in {self.directory}: its state is not finite ({shown} "
            f"hold a NaN or an infinity); {kept}{failed}."
        )

    def _skipped(self, restored: int, damaged: list[DamagedCheckpointError]) -> None:
        """Warn of the damaged steps ``restore`` skipped; a writing manager moves them out of the listing."""
        steps = [e.step for e in damaged]
        moved = ""
        if not self.read_only and self._local:
            aside = os.path.join(self.directory, _DAMAGED)
            if self._primary:
                os.makedirs(aside, exist_ok=True)
                stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
                for s in steps:
                    os.rename(os.path.join(self.directory, str(s)), os.path.join(aside, f"{s}-{stamp}"))
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("substrax.checkpoint: damaged steps moved aside")
            self.orbax.reload()
            moved = f"; moved to {aside}"
        more = f" (older damaged steps skipped too: {steps[1:]})" if len(steps) > 1 else ""
        warnings.warn(
            f"restored step {restored}, the newest whole step: {str(damaged[0]).rstrip('.')}{more}{moved}.",
            skip_file_prefixes=(PACKAGE_DIR,),
        )

    def _sweep(self, *, block: bool = False) -> None:
        """Delete orbax's trash in the background (``block``: before returning); not while a save commits."""
        if self.read_only or not self._local or not self._primary:
            return
        trash = os.path.join(self.directory, _TRASH)
        if os.path.isdir(trash):
            os.rename(trash, f"{trash}-{uuid.uuid4().hex}")  # orbax makes a new one when it needs it
        elif not block and not any(name.startswith(f"{_TRASH}-") for name in os.listdir(self.directory)):
            return
        if self._sweeper is not None and self._sweeper.is_alive():
            if not block:
                return  # the next sweep takes what this one left
            self._sweeper.join()
        self._sweeper = threading.Thread(
            target=_remove_trash, args=(self.directory,), name="substrax-checkpoint-sweep", daemon=True
        )
        self._sweeper.start()
        if block:
            self._sweeper.join()

    def _close_at_exit(self, raised: bool) -> None:
        """Close a manager left open at the script's end, finishing its save (unless it raised)."""
        if self._closed:
            return
        saving = self.orbax.is_saving_in_progress()
        step = max(self.orbax.all_steps(), default=None)
        said = (
            f"substrax.checkpoint: the CheckpointManager of {self.directory} was still open as the "
            f"script ended"
        )
        if raised and jax.process_count() > 1:
            if saving and self._primary:
                print(f"{said} (raising): step {step}, still being written, is not kept.", file=sys.stderr)
            return
        try:
            self.close()
        except SystemExit:
            pass
        except Exception as e:  # noqa: BLE001  (at exit: say it in one line)
            if self._primary:
                print(f"{said}, and its save of step {step} failed: {reason(e)}.", file=sys.stderr)
            return
        if saving and self._primary:
            print(
                f"{said}: step {step}, still being written, was committed. Close the manager "
                f"(or open it in a `with` block) to finish its saves where you choose.",
                file=sys.stderr,
                flush=True,
            )

    def _exit_on_notice(self, step: int, repeated: int | None) -> NoReturn:
        """After a SIGTERM or JAX's preemption notice: ``step`` committed and said; close, exit 143."""
        self.wait()  # committed before it is said to be saved
        if self._primary:
            why = "SIGTERM" if self._listening or self._agree_on_sigterm else "JAX's preemption notice"
            saved = (
                f"step {step} saved"
                if repeated is None
                else f"step {step}'s state is step {repeated}'s, kept"
            )
            print(
                f"substrax.checkpoint: {why}: {saved} in {self.directory}; exiting (143).",
                file=sys.stderr,
                flush=True,
            )
        self.close()
        raise SystemExit(SIGTERM_EXIT)
