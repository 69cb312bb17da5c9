"""Sans-I/O runtime: events, effects, compiled machines and the transfer table."""
