"""Adapters between the sans-I/O core and the outside world: ``zmq`` carries control messages (the transfer
engines that move KV bytes are ``moriio_fsm.engines``).

Rules: adapters own every thread and socket (the core owns none) and turn what they observe into events.
"""
