"""weights: where host-side weights come from — HF safetensors checkpoints (checkpoint: name mapping,
validation, the spec's quantisation recipe) and seeded random weights at O(1) scale (random_weights)."""
