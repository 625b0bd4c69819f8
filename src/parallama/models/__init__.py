"""Model families, one folder each (`llama/`)."""
