"""Guards and effects bound to each spec, one module per spec."""
