"""The vLLM KV connector built on the runtime."""
