"""allocators: the pure-Python bookkeeping every backend shares — paged-KV block manager (kv), GDN state
slots (slots), a sequence's slot + block table (sequences). Imports no CUDA; tested on CPU."""
