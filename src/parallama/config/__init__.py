"""The Hydra config's keys: each key's type, valid values and default (`schema`) and a `_target_` part built with
its errors in one line (`parts`). What relates keys to each other, the machine and the files is app/checks.py."""
