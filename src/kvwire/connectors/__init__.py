"""The connectors kvwire ships. Each is imported only when it is resolved."""
