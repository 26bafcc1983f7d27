"""weights: where weights come from — HF safetensors checkpoints (checkpoint: names, validation, the
recipe on the host; streaming: one tensor at a time onto a device), converted containers (convert,
container), the device plane set both build (planes), and seeded random weights (random_weights). A model's
vision tower (`visual.*`) loads to the host and travels in containers, never to a device."""
