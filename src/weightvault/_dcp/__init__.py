"""The private halves of :mod:`weightvault.dcp`: DCP's planner, storage writer and reader."""
