"""env: the environment variables the CLI, the bench and the lab honour, translated at those edges into
`CompileOptions` and a build root. Nothing below the edges reads the environment: the compiler takes
options, the runtime takes options and paths."""
from __future__ import annotations

import os
from typing import Mapping

from compiler.options import CompileOptions

VARIABLES = {
    "NINFER_BUILD_DIR": "kernel cache root (default build/)",
    "NINFER_DEBUG": "1 type-checks the graph after every pass (else once per pipeline); 2 also prints it",
    "NINFER_CONCURRENCY": "independent GEMVs that run at once as graph branches (default 4; 1 = serial)",
    "NINFER_NORM_FOLD": "0 keeps the RMSNorm kernels of decode steps (A/B measurements)",
    "NINFER_CONV_FOLD": "0 keeps the GDN conv kernel of one-token steps (A/B measurements)",
    "NINFER_PDL": "0 turns off programmatic dependent launch on sm_90+",
    "NINFER_GEMV": "experiment rules for decode-GEMV key fields, e.g. 5120x6144:min_blocks=3;prefetch=1",
    "NINFER_FOLD_IN_VERIFY": "0 folds each speculative round's records in a commit step at the round's start "
                             "instead of inside the next round's verify (default 1: two record sets in turn)",
    "NINFER_CHAIN": "decode GEMVs in fewer launches: off (default), group (each group of concurrent GEMVs one "
                    "launch) or chain (runs of consecutive GEMV groups one launch)",
}


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1", "false", "true"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value in ("1", "true")


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer") from None


def compile_options(environ: Mapping[str, str] = os.environ, **overrides) -> CompileOptions:
    """CompileOptions from NINFER_* variables (unset: the shipped defaults); `overrides` win."""
    d = CompileOptions()
    fields = dict(norm_fold=_flag(environ, "NINFER_NORM_FOLD", d.norm_fold),
                  conv_fold=_flag(environ, "NINFER_CONV_FOLD", d.conv_fold),
                  pdl=_flag(environ, "NINFER_PDL", d.pdl),
                  concurrency=_int(environ, "NINFER_CONCURRENCY", d.concurrency),
                  gemv=environ.get("NINFER_GEMV", d.gemv), debug=_int(environ, "NINFER_DEBUG", d.debug),
                  fold_in_verify=_flag(environ, "NINFER_FOLD_IN_VERIFY", d.fold_in_verify),
                  chain=environ.get("NINFER_CHAIN", d.chain))
    return CompileOptions(**(fields | overrides))


def build_root(environ: Mapping[str, str] = os.environ) -> str | None:
    """NINFER_BUILD_DIR, or None for the default `build/` of the repository."""
    return environ.get("NINFER_BUILD_DIR") or None
