"""The command-line tools, one module each (`parallama-<tool>`, pyproject.toml's [project.scripts]), all Hydra apps
over conf/<tool>.yaml behind one front door (`app`: compose, check once, run, errors as one line and an exit
status):

    train.py      parallama-train      prepare.py   parallama-prepare    evaluate.py  parallama-eval
    export.py     parallama-export     generate.py  parallama-generate   plan.py      parallama-plan
    ckpt.py       parallama-ckpt convert
"""
