"""ranks: `ninfer-gen run|bench --tp N` — the same command in N rank processes (ninfer_gen.parallel, gloo),
each holding its share of the model (compiler.shard) on the reference backend. Every rank computes the same
tokens; rank 0 prints them and writes the files, the others stay silent. The GPU runtime over NCCL is not
built yet."""
from __future__ import annotations


def in_rank() -> bool:
    """Whether this process is already one rank of a group (so a `--tp` command does not launch again)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def is_lead() -> bool:
    """Whether this process speaks for the command: outside a group, or its rank 0."""
    import torch.distributed as dist

    return not in_rank() or dist.get_rank() == 0


def reference_backend(args, what: str) -> None:
    """--tp N > 1 runs on the reference backend: `args.backend` becomes it (an explicit gpu is refused)."""
    if args.backend == "gpu":
        raise ValueError(f"{what} --tp {args.tp} runs on the reference backend (gloo): the GPU runtime over NCCL is "
                         "not built yet")
    args.backend = "reference"


def launch_command(argv: list[str], tp: int) -> int:
    """The command `argv` in `tp` rank processes; rank 0's exit code."""
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
