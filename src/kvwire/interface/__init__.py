"""The connector interface and the records the engine exchanges with connectors."""
