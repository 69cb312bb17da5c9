"""Exhaustive model checking over specs."""
