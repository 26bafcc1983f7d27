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


def launch_command(args) -> int:
    """The command `args.argv` in `args.tp` rank processes, each through `args.cli_main` (the CLI's main, which
    parsed it); rank 0's exit code."""
    from ninfer_gen.parallel import RankFailed, launch

    try:
        return launch(args.tp, _rank, args.argv, args.cli_main)[0]
    except RankFailed as failure:
        if failure.rank == 0 and not failure.message:
            return 2                               # rank 0 has printed its error where the user reads it
        raise


class CommandFailed(RuntimeError):
    """A rank's command ended with an error it has already put in words (ninfer_gen.parallel reports the
    words, not a traceback)."""
    quiet = True


def _rank(rank: int, argv: list[str], main) -> int:
    import io
    import os
    import sys

    said = io.StringIO()
    if rank:                                       # the others' output is rank 0's; their errors are kept
        sys.stdout, sys.stderr = open(os.devnull, "w"), said
    code = main(argv)
    if code:
        lines = said.getvalue().strip().splitlines()
        if not rank:
            raise CommandFailed("")                # its error went to the terminal
        raise CommandFailed(lines[-1].removeprefix("error: ") if lines else f"`ninfer-gen {' '.join(argv)}` "
                            f"exited with {code}")
    return code
