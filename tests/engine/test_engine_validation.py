"""Bad parameters raise ValueError with a message naming the field, before anything enters
the engine; a rejected request leaves no trace and the engine keeps working."""

from __future__ import annotations

import re

import pytest

from tests.support.engine import (
    TINY_VOCAB,
    assert_no_leaks,
    build_llm,
    greedy,
    random_prompt,
    run_batch,
    tiny_engine,
)
from tinyserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", 1e39),  # inf in float32: -inf / inf = NaN sampled token 0
        ("logit_bias", {"1_0": 1.0}),  # int() read these as token 10
        ("logit_bias", {" 10": 1.0}),
        ("logit_bias", {"\u0661\u0660": 1.0}),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_k", -2),
        ("n", 0),
        ("max_tokens", -5),
        ("min_p", 1.5),
        ("logprobs", -1),
        # The offline API's wrong types: TypeError / AttributeError from the engine before.
        ("prediction", "def f(): pass"),
        ("prediction", [1, "2"]),
        ("structured_outputs", {"json": {"type": "object"}, "regexp": "a"}),
        ("structured_outputs", "json"),
        ("logit_bias", [(1, 2.0)]),
        ("stop", 5),
        ("stop_token_ids", 7),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_offline_containers_of_the_right_shape_are_taken():
    p = SamplingParams(structured_outputs={"regex": "[ab]+"}, prediction=[3, 4], stop="x",
                       stop_token_ids=(5,))  # fmt: skip
    assert p.structured_outputs.regex == "[ab]+" and p.prediction == (3, 4)
    assert p.stop == ["x"] and p.stop_token_ids == [5]


def test_settings_of_the_right_kind_are_taken():
    from tinyserve.engine.arg_utils import EngineArgs

    args = EngineArgs(kv_cache_memory=2e9, enforce_eager=1, max_num_seqs=True + 7)
    assert args.create_configs().cache.kv_cache_memory == 2_000_000_000


def test_tiny_temperatures_are_greedy_or_raised_as_vllm():
    """Below 1e-5 greedy (1e-46 was 0 in the float32 column but sampled at T = 1 by the
    host's reading, and differently alone and batched); below 1e-2 raised to 1e-2 (1e-40
    overflowed logits / T into ties of every positive logit)."""
    assert SamplingParams(temperature=1e-46).temperature == 0.0
    assert SamplingParams(temperature=9e-6).temperature == 0.0
    assert SamplingParams(temperature=1e-4).temperature == 0.01
    assert SamplingParams(temperature=0.02).temperature == 0.02


def test_edge_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, n=1, max_tokens=1)
    SamplingParams(top_p=1e-6, top_k=0)


@pytest.fixture(scope="module")
def small_engine(tiny_qwen2_path):
    return tiny_engine(tiny_qwen2_path, num_blocks=32, block_size=4, max_model_len=MAX_MODEL_LEN)


def _bad_requests():
    ok = random_prompt(10, seed=1)
    return [
        ("prompt", [], greedy(4)),
        ("prompt", random_prompt(MAX_MODEL_LEN, seed=2), greedy(1)),  # no room for output
        ("prompt", random_prompt(MAX_MODEL_LEN + 9, seed=3), greedy(1)),
        ("max_tokens", random_prompt(MAX_MODEL_LEN - 4, seed=4), greedy(8)),
        ("max_tokens", ok, greedy(MAX_MODEL_LEN)),
        ("prompt", [*ok, TINY_VOCAB], greedy(4)),  # token id out of vocab
        ("prompt", [-1, *ok], greedy(4)),
        ("stop_token_ids", ok, greedy(4, stop_token_ids=[TINY_VOCAB + 5])),
        ("logit_bias", ok, greedy(4, logit_bias={TINY_VOCAB: 1.0})),
        ("stop", ok, greedy(4, stop=["x"])),  # stop strings need a tokenizer
    ]


@pytest.mark.parametrize("case", range(len(_bad_requests())))
def test_bad_requests_are_rejected_naming_the_field(small_engine, case):
    field, prompt, params = _bad_requests()[case]
    with pytest.raises(ValueError, match=rf"\b{re.escape(field)}\b"):
        small_engine.add_request(f"bad{case}", prompt, params)
    assert_no_leaks(small_engine)


def test_engine_serves_after_rejections_and_at_the_edge_of_the_context(small_engine):
    edge = random_prompt(MAX_MODEL_LEN - 4, seed=5)
    got = run_batch(
        small_engine,
        [
            ("edge", edge, greedy(4)),
            ("open", edge, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)),
        ],
    )
    assert len(got["edge"].token_ids) == 4 and got["edge"].finish_reason == "length"
    # No max_tokens: the context window ends it.
    assert len(got["open"].token_ids) == 4 and got["open"].finish_reason == "length"
    small_engine.add_request("dup", edge, greedy(2))
    with pytest.raises(ValueError, match="dup"):
        small_engine.add_request("dup", edge, greedy(2))
    run_batch(small_engine, [])
    assert_no_leaks(small_engine)


def test_engine_config_errors_name_the_field(tiny_qwen2_path):
    with pytest.raises(ValueError, match="max_model_len"):  # over the KV capacity (8 x 4)
        tiny_engine(tiny_qwen2_path, num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):  # over the model's positions
        tiny_engine(tiny_qwen2_path, num_blocks=1024, block_size=4, max_model_len=4096)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        tiny_engine(tiny_qwen2_path, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        tiny_engine(tiny_qwen2_path, max_num_seqs=0)
    # Wrong types are named before the model loads (TypeError from inside the engine before).
    for name, value in [("num_blocks", "5"), ("max_num_seqs", 2.5), ("enable_prefix_caching",
                        "yes"), ("gpu_memory_utilization", "0.5"), ("block_size", True)]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{name} must be"):
            tiny_engine(tiny_qwen2_path, **{name: value})


def test_llm_generate_rejects_a_bad_prompt_without_leaving_requests(tiny_qwen2_path):
    llm = build_llm(
        model=tiny_qwen2_path,
        load_tokenizer=False,
        num_blocks=32,
        block_size=4,
        max_model_len=MAX_MODEL_LEN,
    )
    good = random_prompt(8, seed=6)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([good, random_prompt(MAX_MODEL_LEN + 1, seed=7)], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["text needs a tokenizer"], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [greedy(4)], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    [out] = llm.generate([good], greedy(4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert_no_leaks(llm.engine)


def test_an_interrupted_generate_leaves_the_llm_usable(tiny_qwen2_path, monkeypatch):
    """Ctrl+C in a notebook mid-generate: its requests stayed queued and every later call
    met their outputs (KeyError 'llm-1', for good). They are aborted on the way out."""
    llm = build_llm(model=tiny_qwen2_path, load_tokenizer=False, num_blocks=32, block_size=4,
                    max_model_len=MAX_MODEL_LEN)  # fmt: skip
    good = random_prompt(8, seed=6)
    [want] = llm.generate([good], greedy(4), use_tqdm=False)
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([good, random_prompt(9, seed=8)], greedy(12), use_tqdm=False)
    monkeypatch.setattr(llm.engine, "step", step)
    assert not llm.engine.has_unfinished()
    [out] = llm.generate([good], greedy(4), use_tqdm=False)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_n_children_near_the_seed_limit_are_all_added_and_reproducible(small_engine):
    """seed = 2**63 - 1 with n=3: seed + i used to overflow SamplingParams' int64 range while
    the children were being added, leaving child 0 orphaned (holding KV blocks) and the client
    with a 500. Children's seeds now wrap within int64; the request runs whole."""
    prompt = random_prompt(6, seed=41)
    params = SamplingParams(n=3, seed=2**63 - 1, temperature=1.0, max_tokens=4)
    first = run_batch(small_engine, [("edge", prompt, params)])
    assert sorted(first.choices["edge"]) == [0, 1, 2]
    again = run_batch(small_engine, [("edge", prompt, params)])
    assert [again.choices["edge"][i].token_ids for i in range(3)] == [
        first.choices["edge"][i].token_ids for i in range(3)
    ]
    assert_no_leaks(small_engine)


def test_a_colliding_child_id_rejects_the_whole_request(small_engine):
    prompt = random_prompt(5, seed=42)
    small_engine.add_request("dup#1", prompt, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="dup#1"):
        small_engine.add_request("dup", prompt, SamplingParams(n=2, max_tokens=3))
    assert set(small_engine.core.scheduler.requests) == {"dup#1"}  # no orphaned "dup#0"
    run_batch(small_engine, [])
    assert_no_leaks(small_engine)


@pytest.mark.slow
def test_llm_chat_takes_content_parts_and_names_bad_messages(smol_llm):
    """OpenAI-style content parts went to the template as a list (jinja's TypeError), a
    message without a role or content failed inside jinja: parts are joined as the server
    joins them; bad messages are a ValueError naming them."""
    plain = [{"role": "user", "content": "Name three colors.\nBe brief."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three colors."},
                                          {"type": "text", "text": "Be brief."}]}]  # fmt: skip
    assert smol_llm.apply_chat_template(parts) == smol_llm.apply_chat_template(plain)
    [a] = smol_llm.chat(parts, greedy(4), use_tqdm=False)
    [b] = smol_llm.chat(plain, greedy(4), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for bad, words in (([{"content": "hi"}], "messages[0]"),
                       ([{"role": "user", "content": None}], "messages[0]"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}],
                        "messages[0].content"), ("hello", "messages")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(words)):
            smol_llm.chat(bad, greedy(4), use_tqdm=False)
    assert not smol_llm.engine.has_unfinished()
