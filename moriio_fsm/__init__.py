"""moriio-fsm: the KV-cache transfer lifecycle of P/D serving as declarative state machines."""

__version__ = "0.1.0"
