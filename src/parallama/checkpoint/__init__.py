"""Checkpoints of every strategy: reading, safe (weights-only) loading, atomic writing, the universal state."""
