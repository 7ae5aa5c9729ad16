"""The matching rule of ``compare``: compiled buffers against expected ones (census guide, "The rule").

``_assign`` pairs them (``_kinds`` and ``_shapes`` say which may pair), ``_differences`` says
what stayed apart, ``_result`` runs both and holds what was found.
"""

from substrax.census._match._kinds import kind_key, ordered_keys
from substrax.census._match._result import Match, match

__all__ = ["Match", "kind_key", "match", "ordered_keys"]
