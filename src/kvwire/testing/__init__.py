"""kvwire's conformance kit for KV connectors: a pytest plugin and a reusable suite."""
