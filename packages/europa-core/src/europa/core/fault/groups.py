"""This rank's replica group among the others, through torchft.

Design note. Each replica group is a job of its own; on every rank a torchft ``Manager``
joins it to the others (its rank 0 hosts the group's manager server, which asks the
Lighthouse for each step's quorum). A step runs:

1. ``start_step``: the quorum, synchronously (``use_async_quorum=False``), so a group that
   joins late or restarts is healed before its forward: torchft picks a healthy group at
   the newest step, and each rank receives the state of the same rank there over the
   reconfigured process group (torchft's ``PGTransport``), into its own tensors. Nothing
   is read from disk. The step to run is the quorum's, not the group's own count. A
   group's first quorum that heals it from no one reads the run's newest checkpoint at
   that moment, if one is ahead (``continue_from``): after a full stop every group reads
   the same save; a group restarted (``--max-restarts``) while the others went on and
   left reads what they saved last, and trains nothing past ``training.steps``.
2. ``average``: every cross-replica sum, among the ranks ``k`` of the participating groups.
3. ``commit``: the vote. The optimizer steps only if every group in the quorum finished
   the step; otherwise the step is retried with the same data.

torchft is imported here only: a run without ``fault_tolerance.enabled`` never needs it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch

from europa.core.errors import LaunchError

REPLICA_ID = "europa_replica_{}"  # torchft reads the group's index from trailing digits


@dataclass(frozen=True)
class StepStart:
    step: int  # the quorum's committed steps: the step this group runs next
    participants: int
    healed_s: float | None  # the seconds this group spent receiving a peer's state


class TorchftReplicaGroups:
    """``europa.spec.replicas.ReplicaGroups`` over torchft (see the design note)."""

    def __init__(
        self,
        config,
        group: int,
        group_rank: int,
        group_size: int,
        state: Callable[[], dict],
        load_state: Callable[[dict], None],
    ) -> None:
        from europa.core.fault import quiet_torchft

        quiet_torchft()
        try:
            from torchft.checkpointing.pg_transport import PGTransport
            from torchft.manager import Manager
            from torchft.process_group import ProcessGroupGloo
        except ImportError as err:
            raise LaunchError(
                f"fault_tolerance.enabled = true: torchft is not installed ({err}); "
                "expected `pip install torchft`"
            ) from None
        ft = config.fault_tolerance
        self._healed = False  # this step's quorum handed this group a peer's state
        self._left = False
        self._load_state = load_state
        step = timedelta(seconds=ft.step_timeout_s)
        host = advertised_host(ft.lighthouse)
        store = self._store_reached_at(host, group_rank)
        self._pg = ProcessGroupGloo(timeout=timedelta(seconds=ft.process_group_timeout_s))
        transport = PGTransport(self._pg, timeout=step, device=torch.device("cpu"))
        with _manager_server_bound_to(host):
            self.manager = Manager(
                pg=self._pg,
                load_state_dict=self._healing,
                state_dict=state,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,
                timeout=step,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=step,
                rank=group_rank,
                world_size=group_size,
                store_addr=store[0],
                store_port=store[1],
                lighthouse_addr=ft.lighthouse,
                replica_id=REPLICA_ID.format(group),
                hostname=host,
                checkpoint_transport=transport,
                init_sync=True,
            )

    def _store_reached_at(self, host: str, group_rank: int) -> tuple[str, int]:
        """The store torchft's cross-group process groups meet at, which the other groups
        must reach: the group's own where it listens on ``host`` (one machine: loopback),
        else one this group's rank 0 hosts on ``host`` alone, its port shared with the
        group's ranks."""
        own = group_store_address()
        if own[0] == host:
            return own
        import torch.distributed as dist

        from europa.core.launch.stores import store_server

        port = [None]
        if group_rank == 0:
            self._replica_store = store_server(host, 0)  # held: the groups meet there
            port = [self._replica_store.port]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(port, src=0)
        return host, int(port[0])

    def _healing(self, state: dict) -> None:
        self._load_state(state)
        self._healed = True

    def start_step(self) -> StepStart:
        started = time.perf_counter()
        self._healed = False
        self.manager.start_quorum()  # a heal, if any, is received and loaded inside it
        step = self.manager.current_step()
        # At step 0 torchft hands some ranks of a group a peer's initial state and not
        # others (it spreads each rank's source over the groups): every group starts from
        # the same seed, so that is no heal, and the group's ranks agree on whether they
        # were healed (what they do next, and record, depends on it).
        healed = time.perf_counter() - started if self._healed and step > 0 else None
        return StepStart(step, self.participants(), healed)

    def continue_from(self, step: int) -> None:
        """This group's committed steps are ``step`` (it loaded the checkpoint of that step
        from disk: no group was ahead to heal it)."""
        self.manager.load_state_dict(
            {"step": step, "batches_committed": self.manager.batches_committed()}
        )

    def average(self, tensors: Sequence[torch.Tensor]) -> None:
        """One collective per dtype: the tensors flattened into one buffer."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def maximum(self, tensor: torch.Tensor) -> None:
        """torchft's allreduce with MAX: gloo and NCCL reduce it exactly (no averaging)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.MAX).wait()

    def participants(self) -> int:
        return self.manager.num_participants()

    def commit(self) -> bool:
        return self.manager.should_commit()

    @property
    def writes_checkpoints(self) -> bool:
        """One group of the quorum writes the checkpoints on disk: its first."""
        return self.manager.participating_rank() == 0

    def shutdown(self) -> None:
        """Leave: the manager's server and threads end (once; again does nothing)."""
        if not self._left:
            self._left = True
            self.manager.shutdown(wait=False)


@contextmanager
def _manager_server_bound_to(host: str) -> Iterator[None]:
    """torchft 0.2.0 binds a group's manager server to every interface (``[::]``); it
    listens on ``host`` alone (the address it advertises), as every other server of a run
    here does."""
    import torchft.manager as module

    original = module.ManagerServer
    where = f"[{host}]" if ":" in host else host

    def on_host(*args, bind: str, **kwargs):
        return original(*args, bind=bind.replace("[::]", where, 1), **kwargs)

    module.ManagerServer = on_host
    try:
        yield
    finally:
        module.ManagerServer = original


def group_store_address() -> tuple[str, int]:
    """The group's TCP store, where torchft's manager server leaves its address: the one
    the group's launcher named, else the one this process group started on."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while not hasattr(store, "host"):  # a PrefixStore around the TCP store
        store = store.underlying_store
    return store.host, store.port


def advertised_host(lighthouse: str) -> str:
    """The address other groups reach this group's manager at: loopback when the
    Lighthouse is (one machine), else this machine's address toward the Lighthouse."""
    from urllib.parse import urlsplit

    from europa.core.launch.stores import address_toward, is_loopback

    where = urlsplit(lighthouse)
    if is_loopback(where.hostname or ""):
        return "127.0.0.1"
    return address_toward(where.hostname, where.port)
