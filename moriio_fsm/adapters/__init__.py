"""Adapters between the sans-I/O core and the outside world: ``moriio`` moves KV bytes, ``zmq`` control messages.

Rules: adapters own every thread and socket (the core owns none) and turn what they observe into events.
"""
