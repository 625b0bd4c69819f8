"""The orchestration on top of the parts: what relates them before any work (`checks`), a command line composed
into a config (`compose`), one training job (`run`) and a checkpoint rewritten for another strategy (`convert`).
Only the command-line tools (cli/) import it."""
