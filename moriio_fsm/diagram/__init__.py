"""State diagrams drawn from specs."""
