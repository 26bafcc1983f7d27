"""engine: what a user of the engine talks to — `load()` and `Model` (api), sampling parameters and the
sampler, the tokenizer. Picks weights and a backend; computes nothing itself and imports no CUDA."""
