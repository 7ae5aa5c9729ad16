"""What a loss function returns: ``loss`` or ``(loss, metrics)``, checked; both modes."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from substrax._base.trees import describe, is_array

__all__ = ["loss_and_metrics"]


def loss_and_metrics(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, metrics)`` from what a loss function returned; ``metrics`` is None without aux.

    Raises:
      ValueError: If the output does not match ``has_aux``, or the loss is not a scalar
        array; the message says what came back and which flag fits it.
      TypeError: If the loss is not a real floating-point number (an int loss has no
        gradient), naming its dtype.
    """
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"With has_aux=True, loss_fn must return (loss, metrics); it returned "
                f"{describe(out)}. If it returns the loss alone, pass has_aux=False."
            )
        loss, metrics = out
    else:
        loss, metrics = out, None
    if isinstance(loss, (tuple, list)):
        raise ValueError(
            f"loss_fn returned {describe(loss)} where the loss goes; if it returns "
            f"(loss, metrics), pass has_aux=True."
        )
    if not is_array(loss) or np.ndim(loss) != 0:
        raise ValueError(f"The loss must be a scalar array; loss_fn returned {describe(loss)}.")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"The loss must be a real floating-point scalar to differentiate; loss_fn returned "
            f"dtype {loss.dtype}. "
            + (
                "Return its real part or magnitude (jnp.real, jnp.abs)."
                if jnp.issubdtype(loss.dtype, jnp.complexfloating)
                else "Return it before any cast to an integer or bool (drop the .astype), or cast it to "
                "float32."
            )
        )
    return loss, metrics
