"""The directory medium: one file per entry under a shared directory."""
