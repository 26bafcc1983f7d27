"""cli: the `ninfer-gen` command, a thin top layer — argument parsing and error lines (main), the bench
command (bench), and the NINFER_* environment variables turned into options at this edge (env).

torch's OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE unless set): spinning threads stall each
other on a busy machine (reference decode 1.3–13 tok/s instead of 30–40 at 2 threads), the bits are the
same. It must be set before torch loads, so here, before anything imports it."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ninfer_gen.cli.main import main  # noqa: E402

__all__ = ["main"]
