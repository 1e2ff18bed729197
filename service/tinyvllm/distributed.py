"""Tensor-parallel state of this process and the collectives the model needs, on torch.distributed.

One process per rank (GPU or CPU worker). `init_tensor_parallel` joins the ranks into one process
group (NCCL on CUDA, gloo on the CPU); `get_tp()` then says which rank of how many this process is.
Without it a process is rank 0 of 1 and every collective returns its input untouched, so
single-process code needs nothing. torch is imported inside the functions: importing this module
costs nothing where torch is not wanted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks that share one model."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """The torch.distributed process group of the ranks (None at size 1)."""

    def all_reduce(self, x: "torch.Tensor") -> "torch.Tensor":
        """Sum x over the ranks, in place; returns x (untouched at size 1)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
        """Every rank's x, concatenated in rank order along `dim` (x itself at size 1).

        Shape: x [..., n, ...] (the same on every rank) -> [..., size * n, ...]
        """
        if self.size == 1:
            return x
        import torch
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim)

    def broadcast(self, x: "torch.Tensor", src: int = 0) -> "torch.Tensor":
        """Rank `src`'s x copied into x on every rank, in place; returns x."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src=dist.get_global_rank(self.group, src), group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (one int; `value` itself at size 1)."""
        if self.size == 1:
            return value
        import torch
        import torch.distributed as dist

        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


_SINGLE = TensorParallel()
_state = _SINGLE


def init_tensor_parallel(rank: int, world_size: int, backend: Optional[str] = None,
                         init_method: str = "env://") -> TensorParallel:
    """Join `world_size` ranks (this process is `rank`) into the tensor-parallel group.

    Args:
        backend: "nccl" or "gloo"; None: nccl where CUDA is available, else gloo. With NCCL,
            select this rank's GPU (torch.cuda.set_device) before the first collective.
        init_method: how the ranks meet: "env://" (MASTER_ADDR / MASTER_PORT),
            "tcp://host:port" or "file:///path".
    Raises:
        RuntimeError: already initialised.
    """
    global _state
    import torch
    import torch.distributed as dist

    if _state.size > 1 or dist.is_initialized():
        raise RuntimeError("init_tensor_parallel: tensor parallelism is already initialised")
    if world_size == 1:
        return _state
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _import_modules_that_bind_world()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _state = TensorParallel(rank=rank, size=world_size, group=dist.group.WORLD)
    return _state


def _import_modules_that_bind_world() -> None:
    """Import, while no group exists, the torch modules that bind `group.WORLD` at import.

    `torch.distributed.nn.functional` takes `group=group.WORLD` as a default argument, evaluated
    when the module is imported, and torch imports it lazily (the first op under
    `torch.device("meta")`, as building a model does). Imported after `init_process_group`, its
    functions would hold the group for the life of the process: `destroy_process_group` would
    not free the backend, and gloo's worker threads would run on into interpreter teardown,
    where one that drops its last collective's tensors takes the GIL and the process aborts
    ("terminate called without an active exception"). Imported here, the defaults are None.
    """
    import torch.distributed.nn.functional  # noqa: F401


def get_tp() -> TensorParallel:
    """This process's tensor-parallel state (rank 0 of 1 before any init)."""
    return _state


def tp_all_reduce(x: "torch.Tensor") -> "torch.Tensor":
    """`TensorParallel.all_reduce` over this process's group."""
    return _state.all_reduce(x)


def tp_all_gather(x: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
    """`TensorParallel.all_gather` over this process's group."""
    return _state.all_gather(x, dim)


def tp_broadcast(x: "torch.Tensor", src: int = 0) -> "torch.Tensor":
    """`TensorParallel.broadcast` over this process's group."""
    return _state.broadcast(x, src)


def destroy_tensor_parallel() -> None:
    """Leave the group (if any); the process is rank 0 of 1 again.

    The backend (gloo's or NCCL's threads) is freed with the last reference to the group: here,
    or when the models built on this state (their `tp` holds it) are freed, whichever is later.
    Free them before the process exits: a backend thread that outlives interpreter teardown
    aborts the process.
    """
    global _state
    if _state.size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    _state = _SINGLE
