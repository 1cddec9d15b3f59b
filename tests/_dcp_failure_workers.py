"""Rank bodies of tests/test_dcp_failures.py (issue 28): one rank fails at one step.

PyTorch's own ``TestDistributedFailure`` (``test/distributed/checkpoint/test_checkpoint.py``)
fails a storage writer or reader on chosen ranks at each step of a save or a load and
expects every rank to raise ``CheckpointException`` naming exactly those ranks. Here the
writer and reader are subclasses of ours (so our own work runs around each fault), the
planners fail in ``finish_plan``, and faults also land in the middle of our work and after
it. Each case writes, per rank, what it raised and when, to ``<out>/<case>.<rank>.json``;
the test asserts on those files, so one spawn of 4 ranks serves every case.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.futures import Future

#: ``(case, call, faults, coordinator)``: ``faults`` maps a step to the ranks failing it.
Case = tuple[str, str, dict[str, list[int]], int]

#: The save cases: upstream's ``test_save_error_handling``, then ours.
SAVES: list[Case] = [
    ("save-ok", "save", {}, 0),
    ("save-set_up_storage_writer-0", "save", {"set_up_storage_writer": [0]}, 0),
    ("save-finish-0", "save", {"finish": [0]}, 0),
    ("save-prepare_global_plan-0", "save", {"prepare_global_plan": [0]}, 0),
    ("save-prepare_local_plan-0", "save", {"prepare_local_plan": [0]}, 0),
    ("save-write_data-2", "save", {"write_data": [2]}, 0),
    ("save-write_data_async-3", "save", {"write_data_async": [3]}, 0),
    ("save-c1-set_up_storage_writer-1", "save", {"set_up_storage_writer": [1]}, 1),
    ("save-c1-finish-1", "save", {"finish": [1]}, 1),
    ("save-finish_plan-2", "save", {"finish_plan": [2]}, 0),
    ("save-write_data_during-1", "save", {"write_data_during": [1]}, 0),
    ("save-write_data_after-3", "save", {"write_data_after": [3]}, 0),
    ("save-commit-0", "save", {"commit": [0]}, 0),
    ("save-storage_meta-1", "save", {"storage_meta": [1]}, 0),
]

#: The load cases: upstream's ``test_load_error_handling``, then ours.
LOADS: list[Case] = [
    ("load-ok", "load", {}, 0),
    ("load-set_up_storage_reader-0", "load", {"set_up_storage_reader": [0]}, 0),
    ("load-prepare_global_plan-0", "load", {"prepare_global_plan": [0]}, 0),
    ("load-read_metadata-0", "load", {"read_metadata": [0]}, 0),
    ("load-prepare_local_plan-1", "load", {"prepare_local_plan": [1]}, 0),
    ("load-read_data-3", "load", {"read_data": [3]}, 0),
    ("load-read_data_async-1", "load", {"read_data_async": [1]}, 0),
    ("load-c3-set_up_storage_reader-0", "load", {"set_up_storage_reader": [0]}, 3),
    ("load-c1-read_metadata-3", "load", {"read_metadata": [3]}, 1),
    ("load-c2-read_data-0", "load", {"read_data": [0]}, 2),
    ("load-c3-read_data_async-2", "load", {"read_data_async": [2]}, 3),
    ("load-c1-prepare_global_plan-1", "load", {"prepare_global_plan": [1]}, 1),
    ("load-finish_plan-3", "load", {"finish_plan": [3]}, 0),
    ("load-read_data_during-2", "load", {"read_data_during": [2]}, 0),
    ("load-read_data_after-1", "load", {"read_data_after": [1]}, 0),
]

#: ``weightvault.dcp.load`` (replicas read once), failing at each of its steps.
WLOADS: list[Case] = [
    ("wload-ok", "wload", {}, 0),
    ("wload-setup-2", "wload", {"setup": [2]}, 0),
    ("wload-read_metadata-1", "wload", {"read_metadata": [1]}, 0),
    ("wload-prepare_local_plan-3", "wload", {"prepare_local_plan": [3]}, 0),
    ("wload-prepare_global_plan-0", "wload", {"prepare_global_plan": [0]}, 0),
    ("wload-finish_plan-3", "wload", {"finish_plan": [3]}, 0),
    ("wload-read_data-1", "wload", {"read_data": [1]}, 0),
    ("wload-read_data_during-0", "wload", {"read_data_during": [0]}, 0),
    ("wload-read_data_after-2", "wload", {"read_data_after": [2]}, 0),
    ("wload-after_exchange-1", "wload", {"after_exchange": [1]}, 0),
]

#: Saves in the background: DCP's ``async_save`` with our writer, and ours.
ASYNC: list[Case] = [
    ("async-ok", "async", {}, 0),
    ("async-prepare_local_plan-1", "async", {"prepare_local_plan": [1]}, 0),
    ("async-write_data-2", "async", {"write_data": [2]}, 0),
    ("async-finish_plan-3", "async", {"finish_plan": [3]}, 0),
    ("async-finish-0", "async", {"finish": [0]}, 0),
    ("wsave-setup-3", "wsave", {"setup": [3]}, 0),
    ("wsave-write_data-1", "wsave", {"write_data": [1]}, 0),
    ("wasync-setup-2", "wasync", {"setup": [2]}, 0),
    ("wasync-write_data-0", "wasync", {"write_data": [0]}, 0),
]

CASES = SAVES + LOADS + WLOADS + ASYNC


class Faults:
    """The steps failing on this rank; :meth:`hit` raises upstream's ``ValueError``."""

    def __init__(self, faults: dict[str, list[int]]) -> None:
        self.rank = dist.get_rank()
        self.faults = faults
        self.failed_at: float | None = None

    def mine(self, step: str) -> bool:
        return self.rank in self.faults.get(step, ())

    def error(self, step: str) -> ValueError:
        self.failed_at = self.failed_at or time.time()
        return ValueError(f"rank fail {self.rank} for {step}")

    def hit(self, step: str) -> None:
        if self.mine(step):
            raise self.error(step)


#: The current case's faults, for the classes ``weightvault.dcp`` builds itself.
FAULTS: list[Faults] = []


def _faults() -> Faults:
    return FAULTS[-1]


def _failed_future(error: BaseException) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_exception(error)
    return fut


def _classes() -> dict[str, Any]:
    """The faulty writer, reader and planners, over ours (built after the ranks start)."""
    import weightvault.dcp as wdcp
    from weightvault._dcp.index import VaultLoadPlanner
    from weightvault._dcp.reader import SharingReader

    class FaultyWriter(wdcp.VaultWriter):
        def storage_meta(self) -> Any:
            _faults().hit("storage_meta")
            return super().storage_meta()

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            _faults().hit("set_up_storage_writer")
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)

        def prepare_local_plan(self, plan: Any) -> Any:
            _faults().hit("prepare_local_plan")
            return super().prepare_local_plan(plan)

        def prepare_global_plan(self, plans: Any) -> Any:
            _faults().hit("prepare_global_plan")
            return super().prepare_global_plan(plans)

        def write_data(self, plan: Any, planner: Any) -> Any:
            f = _faults()
            f.hit("write_data")
            if f.mine("write_data_during"):
                store, real = self.vault.store, self.vault.store.stage

                def stage(key: str, data: Any) -> str:  # after the intent, inside our writes
                    raise f.error("write_data_during")

                store.stage = stage  # type: ignore[method-assign]
                try:
                    return super().write_data(plan, planner)
                finally:
                    store.stage = real  # type: ignore[method-assign]
            fut = super().write_data(plan, planner)
            f.hit("write_data_after")
            if f.mine("write_data_async"):
                return _failed_future(f.error("write_data_async"))
            return fut

        def finish(self, metadata: Any, results: Any) -> None:
            f = _faults()
            f.hit("finish")
            if f.mine("commit"):
                store, real = self.vault.store, self.vault.store.put

                def put(key: str, data: Any, **options: Any) -> bool:
                    if key.startswith("checkpoints/"):
                        raise OSError(28, f"No space left on device ({f.error('commit')})")
                    return real(key, data, **options)

                store.put = put  # type: ignore[method-assign]
                try:
                    return super().finish(metadata, results)
                finally:
                    store.put = real  # type: ignore[method-assign]
            super().finish(metadata, results)

    class ReaderFaults:
        """The reader steps' faults, mixed into our reader and into the one wdcp uses."""

        def prefetch(self) -> Any:
            _faults().hit("setup")
            return super().prefetch()  # type: ignore[misc]

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            _faults().hit("read_metadata")  # where DCP reads it (wdcp.load read it ahead)
            return super().read_metadata(*args, **kwargs)  # type: ignore[misc]

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *a: Any) -> None:
            _faults().hit("set_up_storage_reader")
            super().set_up_storage_reader(metadata, is_coordinator, *a)  # type: ignore[misc]

        def prepare_local_plan(self, plan: Any) -> Any:
            _faults().hit("prepare_local_plan")
            return super().prepare_local_plan(plan)  # type: ignore[misc]

        def prepare_global_plan(self, plans: Any) -> Any:
            _faults().hit("prepare_global_plan")
            return super().prepare_global_plan(plans)  # type: ignore[misc]

        def read_data(self, plan: Any, planner: Any) -> Any:
            f = _faults()
            f.hit("read_data")
            fut = super().read_data(plan, planner)  # type: ignore[misc]
            f.hit("read_data_after")
            if f.mine("read_data_async"):
                return _failed_future(f.error("read_data_async"))
            return fut

        def _read_box(self, *args: Any) -> None:
            _faults().hit("read_data_during")  # after the tables, at the first box
            super()._read_box(*args)  # type: ignore[misc]

        def exchange(self) -> None:
            super().exchange()  # type: ignore[misc]
            _faults().hit("after_exchange")

    class FaultyReader(ReaderFaults, wdcp.VaultReader):
        pass

    class FaultySharing(ReaderFaults, SharingReader):
        pass

    class FinishPlanFaults:
        def finish_plan(self, plan: Any) -> Any:
            _faults().hit("finish_plan")
            return super().finish_plan(plan)  # type: ignore[misc]

    class FaultySavePlanner(FinishPlanFaults, wdcp.VaultSavePlanner):
        pass

    class FaultyLoadPlanner(FinishPlanFaults, DefaultLoadPlanner):
        pass

    class FaultyVaultLoadPlanner(FinishPlanFaults, VaultLoadPlanner):
        pass

    return {
        "writer": FaultyWriter,
        "reader": FaultyReader,
        "sharing": FaultySharing,
        "save_planner": FaultySavePlanner,
        "load_planner": FaultyLoadPlanner,
        "vault_load_planner": FaultyVaultLoadPlanner,
    }


def _state(mesh: Any, base: float) -> dict[str, Any]:
    """Upstream's state: a sharded tensor, a replicated one and a non-tensor value."""
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(400.0).reshape(20, 20) + base
    local = full.chunk(world)[rank].clone()
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"sharded": sharded, "replicated": torch.arange(100.0).reshape(10, 10) + base,
            "bytes": [1, 2, 3, int(base)]}  # fmt: skip


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k in ("sharded", "replicated"):
        a, b = got[k], want[k]
        if hasattr(a, "to_local"):
            a, b = a.to_local(), b.to_local()
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), k
    assert got["bytes"] == want["bytes"], got["bytes"]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same on every rank: a replicated model, as under DDP
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))


def _outcome(error: BaseException | None) -> dict[str, Any]:
    if error is None:
        return {"type": None}
    failures = getattr(error, "failures", {}) or {}
    kinds = {}
    for r, x in failures.items():
        x = x[0] if isinstance(x, tuple) else x  # DCP's (exception, traceback)
        kinds[str(r)] = type(x).__name__
    return {
        "type": type(error).__name__,
        "failures": sorted(int(r) for r in failures),
        "kinds": kinds,
        "message": str(error)[:1500],
        "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None,
    }


def run_cases(rank: int, world: int, root: str, out: str, names: list[str]) -> None:
    """Every case named, in order, each after a barrier; a report per rank and case."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import weightvault
    import weightvault.dcp as wdcp

    classes = _classes()
    mesh = init_device_mesh("cpu", (world,))
    good = _state(mesh, 0.0)
    FAULTS.append(Faults({}))
    dcp.save(good, storage_writer=wdcp.VaultWriter(root, "good"), planner=wdcp.VaultSavePlanner())
    model = _model(0)
    wdcp.save(model, root, "wgood")
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    stored = weightvault.Vault(root).list()[-1].stored_bytes
    for i, (case, call, faults, coordinator) in enumerate(c for c in CASES if c[0] in names):
        f = Faults(faults)
        FAULTS.append(f)
        dist.barrier()
        started = time.time()
        error: BaseException | None = None
        extra: dict[str, Any] = {}
        try:
            extra = _run(call, f"{case}-{i}", coordinator, mesh, root, classes, i + 1)
        except BaseException as e:  # CheckpointException is a BaseException
            error = e
        raised = time.time()
        doc = {"case": case, "started": started, "ended": raised, "failed_at": f.failed_at,
               **_outcome(error), **extra}  # fmt: skip
        dist.barrier()
        # The previous checkpoints still load, bitwise, whatever the case did.
        FAULTS.append(Faults({}))
        target = _state(mesh, -1000.0)
        dcp.load(target, storage_reader=wdcp.VaultReader(root, "good"))
        _same(target, good)
        fresh = _model(9)
        stats = wdcp.load(fresh, root, "wgood")
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, want_model[k]), (case, k)
        doc["names"] = [r.name for r in weightvault.Vault(root).list()]
        reads: list[Any] = [None] * world
        dist.all_gather_object(reads, [stats.bytes_read, stats.bytes_received])
        doc["reads"], doc["stored"] = reads, stored
        with open(os.path.join(out, f"{case}.{rank}.json"), "w") as fh:
            json.dump(doc, fh)


def _run(
    call: str, name: str, coordinator: int, mesh: Any, root: str, classes: dict[str, Any], k: int
) -> dict[str, Any]:
    """One case's save or load; what it returns goes into the report."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    import weightvault.dcp as wdcp

    if call in ("save", "async"):
        state = _state(mesh, float(k))  # new bytes: the save has objects to write
        writer = classes["writer"](root, name)
        planner = classes["save_planner"]()
        if call == "save" and coordinator == 0:
            dcp.save(state, storage_writer=writer, planner=planner)
        elif call == "save":  # what dcp.save runs, with upstream's coordinator moved
            _save_state_dict(state, writer, coordinator_rank=coordinator, planner=planner)
        else:
            dcp.async_save(state, storage_writer=writer, planner=planner).result(timeout=60)
        return {"saved": name}
    if call == "load":
        target = _state(mesh, -1.0)
        reader = classes["reader"](root, "good")
        planner = classes["load_planner"]()
        if coordinator == 0:
            dcp.load(target, storage_reader=reader, planner=planner)
        else:
            _load_state_dict(target, reader, coordinator_rank=coordinator, planner=planner)
        _same(target, _state(mesh, 0.0))
        return {"bytes_read": reader.stats.bytes_read}
    if call == "wload":
        return _patched(classes, lambda: _wload(root))
    model = _model(k)
    if call == "wsave":
        _patched(classes, lambda: wdcp.save(model, root, name))
    else:
        pending = _patched(classes, lambda: wdcp.async_save(model, root, name))
        pending.result(timeout=60)
    return {"saved": name}


def _wload(root: str) -> dict[str, Any]:
    import weightvault.dcp as wdcp

    fresh = _model(5)
    stats = wdcp.load(fresh, root, "wgood")
    want = _model(0)
    for k, v in want.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    return {"bytes_read": stats.bytes_read, "bytes_received": stats.bytes_received}


def _patched(classes: dict[str, Any], run: Callable[[], Any]) -> Any:
    """``run`` with ``weightvault.dcp`` building the faulty classes instead of its own."""
    import weightvault.dcp as wdcp

    saved = wdcp.SharingReader, wdcp.VaultLoadPlanner, wdcp.VaultWriter
    f = _faults()

    class SetupWriter(classes["writer"]):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            f.hit("setup")  # a rank failing before DCP starts
            super().__init__(*args, **kwargs)

    wdcp.SharingReader = classes["sharing"]  # type: ignore[misc]
    wdcp.VaultLoadPlanner = classes["vault_load_planner"]  # type: ignore[misc]
    wdcp.VaultWriter = SetupWriter  # type: ignore[misc]
    try:
        return run()
    finally:
        wdcp.SharingReader, wdcp.VaultLoadPlanner, wdcp.VaultWriter = saved  # type: ignore[misc]
