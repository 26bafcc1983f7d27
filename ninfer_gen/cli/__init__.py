"""cli: the `ninfer-gen` command, a thin top layer — argument parsing and error lines (main), the bench
command (bench), and the NINFER_* environment variables turned into options at this edge (env)."""
from ninfer_gen.cli.main import main

__all__ = ["main"]
