"""Blocks as connectors and media see them: entry format, byte ranges, groups, transfer records."""
