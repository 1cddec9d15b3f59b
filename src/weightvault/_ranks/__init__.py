"""What every rank of a process group shares, below :mod:`weightvault.dcp` and the loops.

- :mod:`~weightvault._ranks.world`: this run's size and rank, a gather, and whether a
  model is sharded;
- :mod:`~weightvault._ranks.failures`: :func:`agree`, the one collective by which every
  rank says whether it failed and all raise together, and the error as it travels;
- :mod:`~weightvault._ranks.store`: a lone writer's failure left where the other ranks
  find it without a collective.

``weightvault.dcp`` (and its private half) and the integrations use the names below.
"""

from .failures import agree, portable, revive
from .store import announce, announced
from .world import gather, rank, sharded_parameter, world_size

__all__ = [
    "agree",
    "announce",
    "announced",
    "gather",
    "portable",
    "rank",
    "revive",
    "sharded_parameter",
    "world_size",
]
