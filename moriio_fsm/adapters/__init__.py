"""Adapters that connect the sans-I/O core to the outside world (ZMQ, RDMA engines)."""
