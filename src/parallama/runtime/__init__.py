"""The processes a run lives in: rank launching, signals and faults, the private internals relied on (compat)."""
