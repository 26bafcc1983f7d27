"""ninfer_gen.serve: what an API server needs between requests and the engine, as a pure-Python library
tested on the CPU — the checkpoint's chat formatting (`chat`: its chat template rendered with Hugging
Face semantics, its special tokens, the chat stop tokens) and the model's output parsed back into
reasoning, content and tool calls, incrementally while tokens stream (`parsing`). The HTTP server
itself (endpoints, request schemas, streaming wire formats) is not here."""
