"""arg_types: argparse value types the subcommands share, so that a bad value is one `error: argument …` line (exit 2)
before anything loads, never a silent default: 0 for `--max-context` once meant the spec's context, −1 for
`--max-tokens` a run of no tokens."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
