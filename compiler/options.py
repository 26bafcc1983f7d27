"""options: `CompileOptions`, every switch that changes what the compiler plans or how the runtime
launches a plan. Passed explicitly to planning and carried by each Plan; never read from the
environment under compiler/ (the CLI and bench edges translate environment variables). The defaults
are the measured winners; the rest exist for A/B measurements.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields


CHAIN_MODES = ("off", "group", "chain")      # CompileOptions.chain (compiler/chains.py)


@dataclass(frozen=True)
class CompileOptions:
    norm_fold: bool = True       # split each decode RMSNorm over the projections around it
    conv_fold: bool = True       # the one-token GDN conv in the qkv projection's epilogue
    pdl: bool = True             # programmatic dependent launch on sm_90+ (templates/common/ptx.cuh)
    concurrency: int = 4         # independent GEMVs that may run at once as graph branches (1 = serial)
    gemv: str = ""               # experiment rules for decode-GEMV key fields (kernels.gemv_rules)
    debug: int = 0               # 1: type-check after every pass (else once per pipeline); 2: also print
    fold_in_verify: bool = True   # fused rounds fold the previous round's records inside the next verify (the GDN
                                  # kernels' commit_record modes, two record sets used in turn) instead of a
                                  # commit bucket at the round's start: −2 launches per GDN layer and round;
                                  # 27B, H100: C8 MTP3 e2e +3.9 % (C8 MTP / plain 1.56 → 1.62×), C1 +1.0 %
    chain: str = "off"           # decode GEMVs in fewer launches (compiler/chains.py): "off", "group" (each group
                                 # of concurrent GEMVs one launch), "chain" (also dependent GEMVs one launch);
                                 # 27B step on an H100: group +2.4 %, chain +22.6 % (sm_86 path +1.3 / +9.2 %)

    def __post_init__(self):
        if not isinstance(self.concurrency, int) or not 1 <= self.concurrency <= 8:
            raise ValueError(f"concurrency {self.concurrency!r}: expected an integer 1..8")
        if self.debug not in (0, 1, 2):
            raise ValueError(f"debug level {self.debug!r}: expected 0, 1 or 2")
        if self.chain not in CHAIN_MODES:
            raise ValueError(f"chain {self.chain!r}: expected one of {', '.join(CHAIN_MODES)}")
        from .kernels.gemv_rules import parse_overrides
        parse_overrides(self.gemv)              # a malformed rule fails here, naming itself

    def record_sets(self, snapshots: bool) -> int:
        """ReplaySSM record sets a lane keeps: 2 when fused rounds fold inside the next verify (the sets written in
        turn, compiler.round.record_buckets), else 1; snapshot mode keeps snapshots instead of records."""
        return 2 if self.fold_in_verify and not snapshots else 1

    def changed(self) -> dict:
        """The fields that differ from the defaults."""
        default = CompileOptions()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def describe(self) -> str:
        """`defaults`, or the changed fields as `name=value` (stable text for plans and build output)."""
        changed = self.changed()
        return " ".join(f"{k}={v!r}" for k, v in sorted(changed.items())) or "defaults"

    @property
    def digest(self) -> str:
        """8 hex digits over every field that can change a plan (not `debug`): part of a plan's identity."""
        text = ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "debug")
        return hashlib.sha256(text.encode()).hexdigest()[:8]
