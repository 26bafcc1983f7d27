"""lanes: the backends as the engine sees them — the contract (`contract`: LaneState, Capabilities,
LaneBackend) and its two implementations, `reference` (the interpreter's lanes, rounds host-side) and `gpu`
(the compiled kernels' lanes, one-graph rounds over `round_rows`), with prefix reuse (`reuse`) shared by both.
Imports the engine's leaf modules (sampling, speculative) and the backends below; never the engine."""
