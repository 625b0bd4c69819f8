"""ParallamaLM against lm-eval's own `hf` model on the same weights (a random tiny Llama written as a Hugging Face
folder), request by request, and the embedded task set. The context is short (128 positions), so long requests
are truncated and rolling texts span several windows; batches of 3 mix lengths, so padding is exercised."""

import json
import os
import stat

import pytest
import torch
from conftest import SMALL_LLAMA
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from parallama.errors import ConfigError
from parallama.evaluation import tasks as embedded
from parallama.evaluation.harness import evaluate, task_manager
from parallama.evaluation.lm import ParallamaLM
from parallama.models import model_spec
from parallama.tokenizer import byte_level


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    spec = model_spec(SMALL_LLAMA)
    config = spec.build_config(SMALL_LLAMA)
    model = spec.model(config)
    out = tmp_path_factory.mktemp("hf")
    spec.hf.save_hf_folder(out, model.state_dict(), config, byte_level().to_str())
    return out


@pytest.fixture(scope="module")
def ours(folder):
    return ParallamaLM(model_dir=str(folder), batch_size=3, device="cpu")


def hf(folder, add_bos_token: bool):
    return HFLM(
        pretrained=str(folder), batch_size=3, device="cpu", dtype="float32", add_bos_token=add_bos_token
    )


DOCS = embedded.cloze_docs(embedded.paragraphs())[:7]


def test_loglikelihood_equals_lm_evals_hf_model(ours, folder):
    reqs = [
        Instance("loglikelihood", {}, (d["context"][: 20 + 15 * i], " " + d["target"]), i)
        for i, d in enumerate(DOCS)
    ]
    reqs.append(Instance("loglikelihood", {}, ("", "An empty context"), len(reqs)))  # the prefix token
    mine, theirs = ours.loglikelihood(reqs), hf(folder, add_bos_token=True).loglikelihood(reqs)
    assert [g for _, g in mine] == [g for _, g in theirs]
    assert [lp for lp, _ in mine] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)
    assert len({lp for lp, _ in mine}) == len(mine)  # not one value for all


def test_rolling_loglikelihood_spans_windows_and_equals_hf(ours, folder):
    strings = [d["context"] * (1 + i % 3) for i, d in enumerate(DOCS)]  # 68 bytes (one window) to 1026 (nine)
    texts = [Instance("loglikelihood_rolling", {}, (s,), i) for i, s in enumerate(strings)]
    mine, theirs = (
        ours.loglikelihood_rolling(texts),
        hf(folder, add_bos_token=False).loglikelihood_rolling(texts),
    )
    assert mine == pytest.approx(theirs, abs=1e-3)


def test_scores_do_not_depend_on_the_batch_size(folder, ours):
    reqs = [
        Instance("loglikelihood", {}, (d["context"][:60], " " + d["target"]), i) for i, d in enumerate(DOCS)
    ]
    one = ParallamaLM(model_dir=str(folder), batch_size=1, device="cpu")
    assert [lp for lp, _ in one.loglikelihood(reqs)] == pytest.approx(
        [lp for lp, _ in ours.loglikelihood(reqs)], abs=1e-5
    )


def test_greedy_generation_equals_hf_and_stops_at_until(ours, folder):
    reqs = [
        Instance("generate_until", {}, (d["context"][: 10 + 3 * i], {"until": ["e"], "max_gen_toks": 8}), i)
        for i, d in enumerate(DOCS)
    ]
    mine = ours.generate_until(reqs)
    assert mine == hf(folder, add_bos_token=True).generate_until(reqs)
    assert all("e" not in text for text in mine)


def test_task_scores_equal_hf_through_lm_eval(ours, folder, tmp_path):
    kwargs = {"cache_dir": str(tmp_path), "limit": 6}
    mine = evaluate(ours, list(embedded.EMBEDDED), **kwargs)
    theirs = evaluate(hf(folder, add_bos_token=True), list(embedded.EMBEDDED), **kwargs)
    assert set(mine) == set(embedded.EMBEDDED) and set(mine["parallama_choice"]) == {"acc", "acc_norm"}
    for task in mine:
        assert mine[task] == pytest.approx(theirs[task], rel=1e-5)


def test_embedded_tasks_are_the_same_bytes_everywhere(tmp_path):
    a, b = embedded.build(tmp_path / "a"), embedded.build(tmp_path / "b")
    assert embedded.build(tmp_path / "a") == a
    for name in embedded.EMBEDDED:
        assert (a / f"{name}.jsonl").read_bytes() == (b / f"{name}.jsonl").read_bytes()
    choice = [json.loads(line) for line in (a / "parallama_choice.jsonl").read_text().splitlines()]
    assert len(choice) == embedded.MAX_DOCS
    paragraphs = embedded.paragraphs()
    for doc in choice[:50]:  # the right ending continues the context's own paragraph; the others do not
        assert len(set(doc["choices"])) == 4
        assert f"{doc['context']} {doc['choices'][doc['label']]}" in paragraphs[choice.index(doc)]
    labels = [doc["label"] for doc in choice]
    assert all(labels.count(k) > 60 for k in range(4))  # no position favoured


def test_the_embedded_tasks_folder_follows_the_umask(tmp_path):
    """It lives in the shared data cache: the umask's modes, not mkdtemp's 0700 (found: drwx------)."""
    old = os.umask(0o002)
    try:
        folder = embedded.build(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o775
    assert {stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()} == {0o664}


def test_an_unknown_task_is_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"tasks: parallama_clozz is not an lm-eval task \(did you mean parallama_cloze\?\)"
    ):
        task_manager(["parallama_clozz"], str(tmp_path))


def test_lm_evals_own_models_stay_registered():
    """lm-eval lists its models only while its registry is empty: registering ours must not hide them."""
    from lm_eval.api.registry import get_model

    assert get_model("hf") is HFLM and get_model("parallama") is ParallamaLM
