"""``python -m weightvault``: the command line, as the ``weightvault`` script runs it."""

from ._cli.app import main

if __name__ == "__main__":
    raise SystemExit(main())
