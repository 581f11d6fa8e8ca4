"""lm-evaluation-harness against a real server, end to end, offline: a multiple-choice task
of our own (tests/data/lm_eval_mc.jsonl, 32 hand-written questions) through lm-eval's
``local-completions`` model — which scores each choice with ``echo``, ``logprobs: 1`` and
the prompt's token ids — gives per-choice loglikelihoods equal to transformers' on the same
GGUF (float32 flags: within 1e-4 a token) and the same accuracy; and a ``generate_until``
task through ``local-chat-completions`` answers every question."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from tests.support.api import MODEL
from tinyserve.config import ServerConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.testing.server import serve

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval_mc.jsonl"

MC_TASK = """task: tinyserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tinyserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} Answer in one word."
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def float32_server(smollm2_gguf_path):
    args = EngineArgs(dtype="float32", kernel_activations="float32", kv_cache_memory="128MiB")
    with serve(AsyncEngine(LLMEngine(args)), ServerConfig()) as s:
        yield s


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    (d / "mc.yaml").write_text(MC_TASK.format(data=DATA))
    (d / "gen.yaml").write_text(GEN_TASK.format(data=DATA))
    return d


def _evaluate(tasks_dir, task: str, model: str, url: str, tokenizer: str, **kw):
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    model_args = {"model": MODEL, "base_url": url, "tokenizer_backend": "huggingface",
                  "tokenizer": tokenizer, "num_concurrent": 4, "max_retries": 1}  # fmt: skip
    return simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks_dir)), **kw)  # fmt: skip


def _references(hf, tokenizer, pairs: list[tuple[str, str]]) -> list[float]:
    """transformers' loglikelihood of each ``continuation`` after its ``context``, the tokens
    split as lm-eval splits them (trailing spaces of the context move to the continuation);
    16 sequences a forward, right-padded (causal: a padded tail changes no earlier row)."""
    seqs = []
    for context, continuation in pairs:
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        seqs.append((whole, len(tokenizer.encode(context, add_special_tokens=False))))
    out = []
    for b in range(0, len(seqs), 16):
        batch = seqs[b : b + 16]
        width = max(len(w) for w, _ in batch)
        ids = torch.tensor([w + [0] * (width - len(w)) for w, _ in batch])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits.double(), -1)
        for row, (whole, ctx) in enumerate(batch):
            out.append(sum(lp[row, i - 1, whole[i]].item() for i in range(ctx, len(whole))))
    return out


@pytest.mark.slow
def test_multiple_choice_loglikelihoods_equal_transformers(float32_server, tasks,
                                                           smollm2_hf, smollm2_tokenizer):  # fmt: skip
    tok_dir = smollm2_tokenizer.name_or_path
    out = _evaluate(tasks, "tinyserve_mc", "local-completions",
                    float32_server.url("/v1/completions"), tok_dir)  # fmt: skip
    samples = out["samples"]["tinyserve_mc"]
    assert len(samples) == 32
    refs = _references(smollm2_hf, smollm2_tokenizer,
                       [tuple(a) for s in samples for a in s["arguments"]])  # fmt: skip
    worst, correct = 0.0, 0
    for j, s in enumerate(samples):
        ours = [r[0][0] for r in s["resps"]]
        ref = refs[4 * j : 4 * j + 4]
        n_tok = [
            len(smollm2_tokenizer.encode(x, add_special_tokens=False)) for _, x in s["arguments"]
        ]
        for a, b, n in zip(ours, ref, n_tok, strict=True):
            worst = max(worst, abs(a - b) / n)
        assert max(range(4), key=ours.__getitem__) == max(range(4), key=ref.__getitem__), s["doc"]
        correct += max(range(4), key=ref.__getitem__) == s["doc"]["answer"]
    assert worst <= 1e-4, worst
    acc = out["results"]["tinyserve_mc"]["acc,none"]
    assert acc == correct / 32
    print(json.dumps({"accuracy": acc, "worst_per_token_diff": worst}))


@pytest.mark.slow
def test_generate_until_through_chat_completions(server, tasks, smollm2_tokenizer):
    out = _evaluate(tasks, "tinyserve_gen", "local-chat-completions",
                    server.url("/v1/chat/completions"), smollm2_tokenizer.name_or_path,
                    apply_chat_template=True, limit=6)  # fmt: skip
    samples = out["samples"]["tinyserve_gen"]
    assert len(samples) == 6
    for s in samples:
        (answer,) = s["filtered_resps"]
        assert isinstance(answer, str) and answer.strip() and "\n" not in answer
    assert 0.0 <= out["results"]["tinyserve_gen"]["exact_match,none"] <= 1.0
