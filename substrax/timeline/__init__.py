"""A compiled step's time, predicted from the program: each operation at its bound on the target,
each collective on the link its axes span, what the compiled schedule overlaps.

``predict(compiled, mesh=...)`` gives a ``Timeline`` (its FLOPs, compute, communication, exposed
and step seconds, and its events, which ``write_trace`` writes as a Chrome trace); ``TARGETS``
holds each accelerator's public numbers (``Target``); ``model_flops`` counts a model's FLOPs
for an MFU. ``substrax.plan`` predicts each row it
compiles for a TPU or a GPU. See the planning guide, "Seconds".
"""

from substrax.timeline._flops import model_flops
from substrax.timeline._targets import LINKS, TARGETS, Target, target_of
from substrax.timeline._timeline import Timeline, predict
from substrax.timeline._walk import Event

__all__ = ["LINKS", "TARGETS", "Event", "Target", "Timeline", "model_flops", "predict", "target_of"]
