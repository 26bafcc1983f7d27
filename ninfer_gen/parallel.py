"""parallel: the processes of tensor parallelism (compiler.shard) — one per rank, torchrun-style. Each rank
process gets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, joins one torch.distributed group (gloo on the
CPU) and runs the same program on its share of the model: every rank makes the same collectives in the same
order and, the gathered logits being the same bits everywhere, chooses the same tokens.

`launch(tp, fn, *args)` runs `fn(rank, *args)` in `tp` processes and returns every rank's result; a rank
that raises fails the launch with its traceback, and the others are stopped rather than left waiting in a
collective. `fn` must be importable by name (a module-level function): the processes are spawned.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import time
import traceback
from datetime import timedelta

COLLECTIVE_TIMEOUT_S = 300      # a rank waiting longer than this in a collective fails (the others are gone)
FAILURE_GRACE_S = 3             # after a rank fails, how long `launch` waits for the others' results


def rank_of(tp: int) -> int:
    """This process's rank in the initialised group of `tp` ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"tensor parallelism over {tp} ranks needs a torch.distributed group: start the ranks "
                           "with ninfer_gen.parallel.launch (or `--tp` on the command line)")
    if dist.get_world_size() != tp:
        raise RuntimeError(f"--tp {tp} in a group of {dist.get_world_size()} processes")
    return dist.get_rank()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp: int, port: int, threads: int, fn, args, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=tp, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # plain pickle bytes: a tensor put on the queue as it is would travel as a file descriptor that this
        # process must still hold when the parent reads it, and the rank may have exited by then
        results.put((rank, True, pickle.dumps(fn(rank, *args))))
    except BaseException as err:                           # noqa: BLE001 — the parent reports it
        results.put((rank, False, str(err) if getattr(err, "quiet", False) else traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(tp: int, fn, *args, threads: int | None = None, timeout_s: float | None = None) -> list:
    """fn(rank, *args) in `tp` spawned processes of one gloo group; their results in rank order.
    `threads`: torch threads per rank (default: the CPUs shared out, at least one); `timeout_s`: the most the
    ranks may take (default: no limit — a server runs until it is stopped)."""
    import multiprocessing as mp
    import queue as queues

    if tp < 1:
        raise ValueError(f"--tp must be ≥ 1, got {tp}")
    threads = threads or max(1, (os.cpu_count() or 1) // tp)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, threads, fn, args, results), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    failed: dict[int, str] = {}
    waited, silent, give_up = 0.0, {}, None
    terminated = _interrupt_on_sigterm()
    try:
        while len(got) + len(failed) < tp and (give_up is None or waited < give_up):
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queues.Empty:
                waited += 1.0
                # a rank that put its result and exited between the wait and this look is not lost: only one
                # still silent a few seconds after it exited is
                for r, p in enumerate(procs):
                    if r not in got and r not in failed and not p.is_alive():
                        silent[r] = silent.get(r, 0) + 1
                        if silent[r] > 5:
                            failed[r] = f"exited (code {p.exitcode}) without a result"
                if timeout_s is not None and waited > timeout_s:
                    raise TimeoutError(f"the {tp} ranks did not finish in {timeout_s:.0f} s")
                continue
            if ok:
                got[rank] = pickle.loads(value)
                continue
            failed[rank] = value
            give_up = give_up or waited + FAILURE_GRACE_S     # the others' words, rank 0's first, a moment longer
        if failed:
            first = min(failed)
            raise RankFailed(first, tp, failed[first])
    finally:
        _stop(procs, finished=len(got) == tp, reported=set(got) | set(failed))
        if terminated is not None:
            signal.signal(signal.SIGTERM, terminated)
    return [got[r] for r in range(tp)]


def _interrupt_on_sigterm():
    """While `launch` waits, SIGTERM interrupts it like SIGINT (so the ranks are stopped, not orphaned: a
    command run in the background ignores SIGINT). Returns the handler to restore (None off the main thread)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:                               # not the main thread: signals are not ours to take
        return None


class RankFailed(RuntimeError):
    """A rank of `launch` failed; `message` is its error ('' when the rank has already printed it)."""

    def __init__(self, rank: int, tp: int, message: str):
        super().__init__(f"rank {rank} of {tp} failed: {message}")
        self.rank, self.message = rank, message


def _stop(procs, finished: bool, reported: set[int]) -> None:
    """Every rank process ended. Interrupted or failed, a lead that has not reported is terminated first — a
    server shuts down gracefully on SIGTERM and releases the followers (engine.replicated) — then whatever is
    left after a grace period is terminated, then killed."""
    grace = 5.0
    if not finished and 0 not in reported and procs[0].is_alive():
        procs[0].terminate()
        grace = 10.0
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
