"""A deterministic in-memory P/D world for joint runs of the machines.

``world`` holds the clock, the lossy channel, the stand-in RDMA engine and the block
ledger (``moriio_fsm.ledger``, which checks every rule about blocks); ``pd`` wires P and D
ranks of both modes together.
"""
