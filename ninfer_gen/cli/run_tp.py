"""run_tp: `ninfer-gen run --tp N` — the same command in N rank processes (ninfer_gen.parallel, gloo), each
holding its share of the model (compiler.shard) on the reference backend. Every rank computes the same
tokens; rank 0 prints them, the others stay silent. The GPU runtime over NCCL is not built yet."""
from __future__ import annotations


def in_rank() -> bool:
    """Whether this process is already one rank of a group (so `run --tp` does not launch again)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def launch_run(argv: list[str], tp: int) -> int:
    from ninfer_gen.parallel import launch

    return launch(tp, _rank, argv)[0]


def _rank(rank: int, argv: list[str]) -> int:
    import os
    import sys

    from ninfer_gen.cli.main import main

    if rank:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    code = main(argv)
    if code:
        raise RuntimeError(f"`ninfer-gen {' '.join(argv)}` exited with {code} on rank {rank}")
    return code
