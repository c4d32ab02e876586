"""kvwire's benchmarks: every figure is a ratio against a bound measured in the same run."""
