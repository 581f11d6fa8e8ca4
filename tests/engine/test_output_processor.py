"""OutputProcessor on its own: fan-out of prompts x n into children, choice indices, usage,
stop strings handed back (not applied), and the seam types the engine's callers rely on."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap

import pytest

from tinyserve.engine.output_processor import OutputProcessor, as_prompts, child_seed
from tinyserve.outputs import ModelRunnerOutput
from tinyserve.request import RequestStatus
from tinyserve.sampling_params import SamplingParams


def _sample(children, runner_tokens: dict[str, int], finished: set[str] = frozenset()):
    """Append each child's token as the scheduler would, finishing the ones named."""
    for req in children:
        if req.request_id in runner_tokens:
            req.append_output_token(runner_tokens[req.request_id])
        if req.request_id in finished:
            req.status = RequestStatus.FINISHED_LENGTH
    return ModelRunnerOutput(sampled_token_ids={r: [t] for r, t in runner_tokens.items()})


def test_fan_out_numbers_children_in_openai_order_and_counts_usage_once_per_prompt():
    proc = OutputProcessor(None, (), max_model_len=64)
    prompts = [[1, 2, 3], [4, 5]]
    children = proc.add_request("r", prompts, SamplingParams(n=2, seed=7, max_tokens=4), 0.0)
    assert [c.request_id for c in children] == ["r#0", "r#1", "r#2", "r#3"]
    assert [c.index for c in children] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in children] == [prompts[0]] * 2 + [prompts[1]] * 2
    # sample j of every prompt draws from seed + j: prompts are independent requests
    assert [c.sampling_params.seed for c in children] == [7, 8, 7, 8]
    assert all(c.sampling_params.n == 1 for c in children)

    out = proc.process(children, _sample(children, {c.request_id: 10 for c in children}))
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert [o.prompt_index for o in out.outputs] == [0, 0, 1, 1]
    assert not any(o.request_finished for o in out.outputs)

    last = proc.process(
        children, _sample(children, {c.request_id: 11 for c in children}, {"r#0", "r#1", "r#2"})
    )
    assert [o.finish_reason for o in last.outputs] == ["length"] * 3 + [None]
    assert not any(o.request_finished for o in last.outputs) and "r" in proc
    children[3].status = RequestStatus.FINISHED_LENGTH
    final = proc.process(children[3:], _sample(children[3:], {"r#3": 12})).outputs
    assert len(final) == 1 and final[0].request_finished
    assert (final[0].usage.prompt_tokens, final[0].usage.completion_tokens) == (5, 9)
    assert "r" not in proc and not proc._parent_of


def test_cached_tokens_count_each_prompt_once_at_its_choices_fewest():
    """n = 2 over two prompts: the second choice of a cold prompt hits the blocks its sibling
    just computed — not a cache hit of the request's. Per prompt the fewest of its choices,
    summed as prompt_tokens sums the prompts (was the largest of all: a cold 200-token prompt
    with n = 2 read 192 cached)."""
    proc = OutputProcessor(None, (), max_model_len=64)
    children = proc.add_request("r", [[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=1), 0.0)
    for req, cached in zip(children, (16, 0, 32, 48), strict=True):
        req.num_cached_tokens = cached
    out = proc.process(children, _sample(children, {c.request_id: 10 for c in children},
                                         {c.request_id for c in children})).outputs  # fmt: skip
    assert out[-1].request_finished and out[-1].usage.cached_tokens == 0 + 32


def test_add_is_all_or_nothing_and_ids_cannot_collide():
    proc = OutputProcessor(None, (), max_model_len=64)
    proc.add_request("a#1", [[1]], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="'a#1' is already in the engine"):
        proc.add_request("a", [[1]], SamplingParams(n=2), 0.0)
    assert "a" not in proc and set(proc._parent_of) == {"a#1"}
    with pytest.raises(ValueError, match="already in the engine"):
        proc.add_request("a#1", [[2]], SamplingParams(), 0.0)


def test_child_seed_wraps_into_int64():
    assert child_seed(None, 3) is None
    assert child_seed(2**63 - 1, 1) == -(2**63)
    assert child_seed(5, 2) == 7


def test_as_prompts():
    assert as_prompts([1, 2]) == [[1, 2]]
    assert as_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert as_prompts([]) == [[]]


def test_stop_string_is_reported_not_applied(smollm2_tokenizer):
    tok = smollm2_tokenizer
    proc = OutputProcessor(tok, (), max_model_len=512)
    params = SamplingParams(stop=["world"], max_tokens=20)
    (req,) = proc.add_request("s", [tok.encode("Say hi")], params, 0.0)
    req.status = RequestStatus.RUNNING
    ids = tok.encode(" hello world again", add_special_tokens=False)
    outs, stops = [], []
    for t in ids:
        step = proc.process([req], _sample([req], {"s": t}))
        outs += step.outputs
        stops += step.stop_string_ids
        if step.stop_string_ids:
            break
    assert stops == ["s"]
    # the processor decided the finish reason; the request's status is the scheduler's to set
    assert req.status == RequestStatus.RUNNING
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "world"
    assert "".join(o.text_delta for o in outs) == " hello "
    assert outs[-1].request_finished and "s" not in proc


def test_torch_free_modules_import_no_torch():
    code = (
        "import sys\n"
        "import tinyserve.engine.output_processor, tinyserve.engine.client\n"
        "import tinyserve.engine.scheduler, tinyserve.engine.kv_cache_manager\n"
        "bad = {'torch', 'numpy'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _statements(fn) -> int:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return sum(isinstance(node, ast.stmt) for s in body for node in ast.walk(s))


def test_engine_core_step_is_schedule_execute_update():
    from tinyserve.engine.core import EngineCore

    assert _statements(EngineCore.step) <= 15
    tree = ast.parse(textwrap.dedent(inspect.getsource(EngineCore.step)))
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    calls = [
        n.func.attr
        for n in sorted(nodes, key=lambda n: (n.lineno, n.col_offset))
        if isinstance(n.func, ast.Attribute)
    ]
    # begin_step: the live engine view's per-step record, only while someone watches;
    # _execute fills the grammars' masks, so that one raising fails the step, not the engine.
    assert calls == [
        "_check_health", "schedule", "begin_step", "_execute", "update_from_output"
    ]  # fmt: skip


def test_an_answer_the_validator_cannot_check_ends_its_request(smollm2_tokenizer, monkeypatch):
    """The check after generation (a schema with oneOf) raising — jsonschema's multipleOf
    over a 330-digit number raised OverflowError before answer_validator.py read it exactly;
    here the check is made to raise so: the request ends in an error naming that, where the
    engine thread died of it."""
    from tinyserve.engine import output_processor
    from tinyserve.sampling_params import StructuredOutputsParams

    def overflowing(schema, text):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(output_processor, "final_check", overflowing)

    schema = {"type": "object", "required": ["qty", "kind"], "properties": {
        "qty": {"type": "number", "multipleOf": 0.5},
        "kind": {"oneOf": [{"const": "a"}, {"const": "b"}]}}}  # fmt: skip
    proc = OutputProcessor(smollm2_tokenizer, (), max_model_len=4096)
    so = StructuredOutputsParams(json=schema, field="response_format")
    (req,) = proc.add_request("r", [[1, 2]], SamplingParams(structured_outputs=so), 0.0)
    answer = smollm2_tokenizer.encode('{"qty": 9' + "7" * 329 + ', "kind": "a"}',
                                      add_special_tokens=False)  # fmt: skip
    for t in answer[:-1]:
        req.append_output_token(t)
    runner_out = _sample([req], {req.request_id: answer[-1]})
    req.status = RequestStatus.FINISHED_STOPPED  # the grammar ended it
    (out,) = proc.process([req], runner_out).outputs
    assert out.finish_reason == "error" and out.error_param == "response_format"
    assert "could not be checked" in out.error and "OverflowError" in out.error
