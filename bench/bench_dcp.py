"""weightvault.dcp against DCP's FileSystemWriter/FileSystemReader, and the cost at 1,024 ranks.

Three commands::

    python bench/bench_dcp.py plan --ranks 1024       # planning, record, one rank's load
    python bench/bench_dcp.py save-load --ranks 2 4   # save/load time on gloo ranks
    python bench/bench_dcp.py async --mib 64          # how long dcp.async_save blocks

``plan`` simulates 1,024 FSDP ranks of a Llama-3.2-1B-shaped model in one process (see
``bench/_dcp_sim.py``): rank 0's global plan with and without the plan cache, the record,
and what one loading rank reads of it.

``save-load`` spawns 2 and 4 gloo ranks holding an FSDP2-sharded (or DDP-replicated)
state and times ``FileSystemWriter``/``FileSystemReader`` against ``VaultWriter``/
``VaultReader`` side by side, alternating, reporting minimums (``bench/_dcp_ranks.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def save_load(mib: int, repeat: int, ranks: list[int], states: list[str]) -> list[Any]:
    """``FileSystemWriter``/``Reader`` against ``VaultWriter``/``Reader`` on gloo ranks."""
    import _dcp_ranks

    out = []
    with tempfile.TemporaryDirectory(prefix="bench-dcp-") as d:
        for kind in states:
            for world in ranks:
                path = os.path.join(d, f"result-{kind}-{world}.json")
                _dcp_ranks.run_ranks(_dcp_ranks.save_load, world, kind, mib, repeat, path)
                with open(path) as f:
                    out.append(json.load(f))
    return out


def async_blocking(mib: int, repeat: int, ranks: int) -> dict[str, Any]:
    """How long an asynchronous save blocks, how long until committed, and its memory."""
    import _dcp_ranks

    with tempfile.TemporaryDirectory(prefix="bench-dcp-async-") as d:
        path = os.path.join(d, "result.json")
        _dcp_ranks.run_ranks(_dcp_ranks.async_saves, ranks, mib, repeat, path)
        with open(path) as f:
            result: dict[str, Any] = json.load(f)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--ranks", type=int, default=1024)
    s = sub.add_parser("save-load")
    s.add_argument("--mib", type=int, default=64)
    s.add_argument("--repeat", type=int, default=5)
    s.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    s.add_argument("--state", nargs="+", choices=["fsdp", "ddp"], default=["fsdp", "ddp"])
    a = sub.add_parser("async")
    a.add_argument("--mib", type=int, default=64)
    a.add_argument("--repeat", type=int, default=3)
    a.add_argument("--ranks", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "plan":
        import _dcp_sim

        result = _dcp_sim.plan_sim(args.ranks)
    elif args.cmd == "async":
        result = async_blocking(args.mib, args.repeat, args.ranks)
    else:
        result = save_load(args.mib, args.repeat, args.ranks, args.state)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
