"""allocators: the pure-Python bookkeeping every backend shares — paged-KV block manager (kv), GDN state
slots (slots), a sequence's slot + block table (sequences), the prefix cache's checkpoints (prefix). Imports
no CUDA; tested on CPU."""
