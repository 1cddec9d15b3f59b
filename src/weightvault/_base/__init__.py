"""The base every other part stands on: errors, types, dtypes, reports, limits, atomic files."""
