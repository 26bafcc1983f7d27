"""executor: the GPU side — the memory plan under one VRAM budget, device weights and state in the
kernels' layouts, module loading and launching (cuda_module), the executable that resolves a Plan's
bindings to pointers and replays CUDA graphs, and the GPU backend on top. Loads cubins; never compiles
a source itself (a cache miss goes to compiler.build_cache)."""
