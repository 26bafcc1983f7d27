"""ninfer_gen: the runtime — weights, reference backend, engine, CLI."""
