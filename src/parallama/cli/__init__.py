"""The command-line tools, one module each (`parallama-<tool>`, see pyproject.toml's [project.scripts])."""
