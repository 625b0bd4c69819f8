"""Checkpoints of every strategy, in one package:

formats.py     which format a path is (`detect`), what each holds, the client state read once
untrusted.py   checkpoints from elsewhere: every pickle weights-only or allow-listed
atomic.py      writing without ever leaving a partial checkpoint (files and folders)
read.py        weights + model config + client state for the tools that only read (export, eval, generate)
universal.py   any strategy's checkpoint, at any world size, as one state any strategy resumes
zero.py        DeepSpeed's ZeRO partitions <-> the universal state
resume.py      when and from what a run resumes, and the checks before it does
"""
