"""The block connector over any medium: its scheduler half and its worker half."""
