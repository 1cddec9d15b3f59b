"""Subprocess bodies of tests/test_vault_compaction.py: compaction in another process.

    python _compaction_workers.py compact ROOT DELAY

compacts the vault at ROOT, sleeping DELAY seconds before each object (so a SIGKILL
lands in the middle of it), and prints ``done <checkpoints> <busy>``.
"""

from __future__ import annotations

import sys
import time

from weightvault import Vault
from weightvault._vault.upkeep.compact import compact


def main(argv: list[str]) -> None:
    what, root, delay = argv[0], argv[1], float(argv[2])
    assert what == "compact", what
    vault = Vault(root, compaction=None)
    report = compact(vault.store, vault.storage, pause=lambda: time.sleep(delay))
    print(f"done {len(report.checkpoints)} {report.busy}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
