"""The attributes a step sets on a layer's module inside its trace, for the layer to hand the
step its work: ``scan_layers`` reads them (``substrax.nn``) and the steps set them."""

__all__ = ["STAGE_HOOK", "UNIT_HOOK"]

# a pipelined step on a staged stack: an object whose ``reached(stack, x, args, kwargs, remat)``
# scan_layers returns instead (substrax._shared.pipeline: the loss cut at the stack)
STAGE_HOOK = "_substrax_stage"
# the explicit step on an FSDP unit: its run, whose ``scan`` runs a prefetched stack (explicit._units)
UNIT_HOOK = "_substrax_unit"
