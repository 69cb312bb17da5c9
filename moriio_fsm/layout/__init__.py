"""KV-cache geometry and transfer offsets: pure functions over torch tensors, no I/O."""
