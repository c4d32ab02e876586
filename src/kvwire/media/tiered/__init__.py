"""The tiered medium: a CPU pool in front of slower media (see `kvwire.media.tiered.medium`)."""
