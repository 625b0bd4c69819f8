"""Benchmarks of parallama: `python -m bench <name>` (see docs/benchmarks.md).

Each benchmark measures the things it compares side by side in one run and reports their ratios; absolute
figures are printed only together with the machine they were measured on.
"""
