"""Serving P/D with real vLLM engines: a tiny model, vLLM server processes, the proxy."""
