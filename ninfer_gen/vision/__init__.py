"""vision: what images become before the model sees them — decoding with checked limits and the Qwen2-VL-family
preprocessing (resize to the patch grid, normalise, patchify) in `preprocess`. Pillow and numpy; no torch, no CUDA."""
