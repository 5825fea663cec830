"""lm-evaluation-harness (`local-completions`, the dev extra) against `copt serve` on the fixture teacher: a
loglikelihood (multiple-choice) task and a generation task from local JSONL files (no downloads), each checked
against what HF transformers computes for the same tokens."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_serve_helpers import running_server

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

DOCS_MC = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "label": 0},
    {"context": "for i in range(", "choices": ["10):", "banana", " while"], "label": 0},
    {"context": "import numpy as", "choices": [" np", " pd", " tf"], "label": 0},
    {"context": "class Foo(object):\n    def __init__(self", "choices": ["):", " cat", " 42"], "label": 0},
]
CONTEXTS_GEN = ["def add(a, b):\n", "import os\nimport", "for i in range(10):\n   "]


def _write_tasks(tmp_path, fixtures, gen_targets: list[str]):
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS_MC))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps({"context": c, "target": t}) + "\n"
                                                for c, t in zip(CONTEXTS_GEN, gen_targets, strict=True)))
    (tmp_path / "copt_mc.yaml").write_text(f"""task: copt_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (tmp_path / "copt_gen.yaml").write_text(f"""task: copt_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_lm_eval_loglikelihood_and_generation_tasks(fixtures, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(fixtures.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(fixtures.teacher, dtype=torch.float32).eval()

    def loglikelihood(context: str, continuation: str) -> float:
        ctx = tok.encode(context, add_special_tokens=False)
        cont = tok.encode(context + continuation, add_special_tokens=False)[len(ctx):]
        ids = ctx + cont
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        return sum(float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))

    expected_acc = sum(max(range(len(d["choices"])), key=lambda i, d=d: loglikelihood(d["context"], d["choices"][i]))
                       == d["label"] for d in DOCS_MC) / len(DOCS_MC)
    targets = []
    for context in CONTEXTS_GEN:  # HF greedy continuations, cut where lm-eval cuts (the stop sequence)
        ids = tok.encode(context, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=model.generation_config.pad_token_id)[0, len(ids):]
        text = tok.decode(out, skip_special_tokens=True)
        targets.append(text.split("\n\n")[0])
    targets[-1] += " (not what the model writes)"  # one miss: exact_match 2/3, so the metric is not vacuous
    _write_tasks(tmp_path, fixtures, targets)

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with running_server(fixtures.teacher, "--served-model-name", "teacher", "--max-model-len", "256") as (url, _):
        args = (f"model=teacher,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={fixtures.tokenizer},tokenized_requests=True,num_concurrent=2,max_retries=1")
        results = simple_evaluate(model="local-completions", model_args=args, tasks=["copt_mc", "copt_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    mc, gen = results["results"]["copt_mc"], results["results"]["copt_gen"]
    assert mc["acc,none"] == pytest.approx(expected_acc)
    # the loglikelihoods lm-eval read from copt serve equal HF's for every choice
    for sample in results["samples"]["copt_mc"]:
        doc = sample["doc"]
        got = [resp[0][0] for resp in sample["resps"]]
        want = [loglikelihood(doc["context"], c) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-3)
    assert gen["exact_match,none"] == pytest.approx(2 / 3)
