"""The embedded task set: lm-eval task YAMLs (beside this file) over data built here from the embedded corpus
(`pydoc_data.topics`, which every CPython ships), so downstream scores need no hub and no download.

- parallama_cloze: a paragraph without its last word; acc (the word is the greedy continuation) and perplexity.
- parallama_choice: the first half of a paragraph and four endings (its own, three from other paragraphs);
  acc and acc_norm.

`build(root)` writes the data (JSON lines) and the YAMLs with their absolute `data_files` into one folder under
`root`, named by a digest of what they depend on (the Python build, this file, the YAMLs): the same folder and
the same bytes on every machine with the same Python, built once, safe when several ranks build it at once.
The data is the training corpus itself: these tasks measure how a run learns its data, not generalization.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from pydoc_data.topics import topics

import yaml

from parallama.data.shards import tmp_name

HERE = Path(__file__).parent
EMBEDDED = ("parallama_cloze", "parallama_choice")
MAX_DOCS = 400  # per task; `limit` takes fewer
CHOICES = 4
ENDING_WORDS = 10
SEED = 1234


def paragraphs() -> list[str]:
    """Prose paragraphs of the help topics, whitespace-normalized, in a fixed order: 12 to 60 words, starting
    with a capital letter, ending with a full stop, mostly words (not code)."""

    out = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            words = block.split()
            if not 12 <= len(words) <= 60 or not words[0][0].isupper() or not block.rstrip().endswith("."):
                continue
            if sum(w.strip(".,;:()\"'").isalpha() for w in words) < 0.8 * len(words):
                continue
            out.append(" ".join(words))
    return list(dict.fromkeys(out))  # a few paragraphs repeat across topics


def cloze_docs(paras: list[str]) -> list[dict]:
    docs = []
    for text in paras:
        *context, last = text.split()
        word = last.rstrip(".")
        if word.isalpha() and len(word) >= 3:
            docs.append({"context": " ".join(context), "target": word})
    return docs[:MAX_DOCS]


def choice_docs(paras: list[str]) -> list[dict]:
    rng = random.Random(SEED)
    halves = []
    for text in paras:
        words = text.split()
        k = len(words) // 2
        halves.append((" ".join(words[:k]), " ".join(words[k : k + ENDING_WORDS])))
    docs = []
    for context, ending in halves:
        others = rng.sample([j for j in range(len(halves)) if halves[j][1] != ending], CHOICES - 1)
        choices = [halves[j][1] for j in others]
        label = rng.randrange(CHOICES)
        choices.insert(label, ending)
        docs.append({"context": context, "choices": choices, "label": label})
    return docs[:MAX_DOCS]


def _digest() -> str:
    h = hashlib.sha256(sys.version.encode())
    for f in sorted([Path(__file__), *HERE.glob("*.yaml")]):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def build(root: str | os.PathLike) -> Path:
    """The folder of the embedded tasks' YAMLs and data under `root` (an lm-eval `include_path`)."""
    out = Path(root, f"lm_eval_tasks-{_digest()}")
    if out.is_dir():
        return out
    Path(root).mkdir(parents=True, exist_ok=True)
    # not mkdtemp, whose 0700 would shut the rest of a team out of a shared cache: the umask's modes
    tmp = Path(tmp_name(str(root), ".lm_eval_tasks-"))
    tmp.mkdir()
    paras = paragraphs()
    for name, docs in (("parallama_cloze", cloze_docs(paras)), ("parallama_choice", choice_docs(paras))):
        data = tmp / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        config = yaml.safe_load((HERE / f"{name}.yaml").read_text())
        config["dataset_kwargs"]["data_files"]["test"] = str(out / data.name)
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        tmp.rename(out)
    except OSError:  # another rank or process built it first: the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
    return out
