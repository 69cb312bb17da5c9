"""ZeroMQ control plane: wire codec, listener, senders and the peer trust policy."""
