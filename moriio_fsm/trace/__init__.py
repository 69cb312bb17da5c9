"""Trace recording and replay of transfer events."""
