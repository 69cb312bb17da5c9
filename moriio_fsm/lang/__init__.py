"""Transfer specs: the YAML model, its loader with precise errors, validation and compilation."""
