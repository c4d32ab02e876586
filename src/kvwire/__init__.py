"""kvwire: KV-cache connectors for LLM inference engines, built through dependency injection."""
