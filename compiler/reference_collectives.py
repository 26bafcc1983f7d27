"""reference_collectives: the torch references of the tensor-parallel primitives (compiler.shard), over
torch.distributed's default process group — gloo on the CPU (the reference backend with --tp), NCCL on
GPUs. Every rank runs the same graph; each call is a collective all ranks make in the same order.
"""
from __future__ import annotations


def _group_of(tp: int):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"a graph sharded over {tp} ranks runs in a torch.distributed process group of {tp} "
                           "processes (ninfer_gen.parallel launches them); none is initialised here")
    if dist.get_world_size() != tp:
        raise RuntimeError(f"a graph sharded over {tp} ranks runs in a group of {tp}, not {dist.get_world_size()}")
    return dist


def all_reduce(x, *, tp):
    """The sum of `x` over the ranks (every rank gets the same bits)."""
    out = x.contiguous().clone()
    _group_of(tp).all_reduce(out)
    return out


def all_gather(x, *, tp):
    """The ranks' `x` side by side along the last axis, rank 0 first ([..., n] → [..., n · tp])."""
    import torch

    dist = _group_of(tp)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
