"""An example third-party kvwire connector package."""
