"""Adapters between the sans-I/O core and the outside world.

``moriio`` moves KV bytes (mori.io or the loopback stand-in) and turns completions into
events; ``zmq`` carries the control messages. Adapters own every thread and socket; the
core owns none.
"""
