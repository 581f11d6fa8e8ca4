"""Prefix caching only changes speed: requests sharing a ~300-token system prompt give the
same tokens with the cache on and off, and once the first request has been computed, the
later ones find most of their prompt's full blocks in the cache (counters checked)."""

from __future__ import annotations

import pytest

from tests.support.engine import Collector, build_engine, drain, greedy

BLOCK_SIZE = 16

RULES = [
    "Greet the visitor by name when the name is known",
    "Answer questions about opening hours, which are nine to six on weekdays",
    "Explain that members may borrow up to twelve books for three weeks",
    "Point out that late returns cost ten cents per day and per book",
    "Offer to reserve titles that are currently on loan",
    "Recommend the reading room on the second floor for quiet study",
    "Remind visitors that food is not allowed near the rare manuscripts",
    "Describe the children's corner, with its weekly story hour on Saturday mornings",
    "Mention the free wireless network and the printing service in the basement",
    "Say that the archive of local newspapers goes back to the year eighteen fifty",
    "Never share the personal details of other members",
    "Keep every answer short, friendly and accurate",
]
QUESTIONS = [
    "When do you open on Monday?",
    "How many books can I borrow?",
    "Is there a place to print my homework?",
    "Can I eat my lunch in the manuscript room?",
    "What happens if I return a book late?",
    "Do you have old newspapers from my town?",
]


def _system_prompt(tokenizer, min_tokens: int = 300) -> str:
    text = "You are the assistant of the Harbour Street Public Library. Follow these rules."
    i = 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < min_tokens:
        text += f" Rule {i + 1}: {RULES[i % len(RULES)]}."
        i += 1
    return text


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def chat_prompts(smol_engine):
    tok = smol_engine.tokenizer
    system = _system_prompt(tok)
    assert 300 <= len(tok.encode(system, add_special_tokens=False)) < 340
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    # The first question again: a prompt whose every full block but the last token's is cached.
    prompts.append(list(prompts[0]))
    return prompts


MAX_TOKENS = [8, 10, 12, 9, 11, 8, 8]


def _run_staggered(engine, prompts, tag):
    """Request 0 first; the others arrive once it has been computed (it has a token)."""
    params = [greedy(m) for m in MAX_TOKENS]
    collector = Collector()
    engine.add_request(f"{tag}0", prompts[0], params[0])
    while not collector.choices.get(f"{tag}0"):
        collector.feed(engine.step())
    kv = engine.core.kv_cache_manager
    before = (kv.prefix_cache_block_queries, kv.prefix_cache_block_hits)
    for i in range(1, len(prompts)):
        engine.add_request(f"{tag}{i}", prompts[i], params[i])
    drain(engine, collector)
    delta = (kv.prefix_cache_block_queries - before[0], kv.prefix_cache_block_hits - before[1])
    return collector, delta


@pytest.mark.slow
@pytest.mark.device
def test_shared_system_prompt_hits_and_identical_outputs(smol_path, chat_prompts, test_device):
    kw = dict(model=smol_path, num_blocks=256, block_size=BLOCK_SIZE, device=test_device)
    off_engine = build_engine(enable_prefix_caching=False, **kw)
    off, off_delta = _run_staggered(off_engine, chat_prompts, "off")
    assert off_delta == (0, 0)

    on_engine = build_engine(**kw)
    on, (queries, hits) = _run_staggered(on_engine, chat_prompts, "on")
    for i in range(len(chat_prompts)):
        assert on[f"on{i}"].token_ids == off[f"off{i}"].token_ids, f"request {i}"
        assert len(on[f"on{i}"].token_ids) == MAX_TOKENS[i]

    later = chat_prompts[1:]
    full_blocks = sum(len(p) // BLOCK_SIZE for p in later)
    assert hits >= 0.7 * full_blocks, (hits, full_blocks)
    assert hits >= 0.7 * queries, (hits, queries)
    for i, prompt in enumerate(later, start=1):
        # At least every full block shared with the (computed) first request is a hit; the
        # last prompt token is always recomputed, so it can never be in a hit block.
        shared = min(_lcp(prompt, chat_prompts[0]), len(prompt) - 1) // BLOCK_SIZE
        assert on[f"on{i}"].num_cached_tokens >= shared * BLOCK_SIZE, f"request {i}"
        assert off[f"off{i}"].num_cached_tokens == 0
    assert on["on6"].num_cached_tokens == (len(chat_prompts[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE

    # Everything again, all prompts cached now: still the same tokens.
    again, (queries2, hits2) = _run_staggered(on_engine, chat_prompts, "again")
    for i in range(len(chat_prompts)):
        assert again[f"again{i}"].token_ids == off[f"off{i}"].token_ids, f"request {i}"
    assert hits2 == queries2  # every full block of every prompt (but the last token's)
    assert (
        on_engine.core.kv_cache_manager.num_free_blocks
        == on_engine.core.kv_cache_manager.num_total_blocks
    )


@pytest.mark.slow
def test_int8_decode_shares_only_prompt_blocks(smol_path, smol_engine):
    """--decode-activations int8: an answer's K/V comes from the int8 decode rows, a later
    prompt holding that answer computes it in prompt rows. Its blocks were shared, so the
    next turn's greedy answer depended on whether they were still cached (a differential
    hunt: " the ages" against " generations" 16 tokens in). Now only prompt blocks are."""
    tok = smol_engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Tell me a short story about "
                                     "a dragon."}], add_generation_prompt=True, tokenize=True)  # fmt: skip
    chat = list(chat if isinstance(chat, list) else chat["input_ids"])
    kw = dict(model=smol_path, num_blocks=256, block_size=BLOCK_SIZE, decode_activations="int8")
    answers, cached = {}, {}
    for caching in (False, True):
        engine = build_engine(enable_prefix_caching=caching, **kw)
        engine.add_request("first", chat, greedy(40))
        first = drain(engine).choices["first"][0].token_ids
        turn = chat + first + tok.encode("\nAnd then", add_special_tokens=False)
        engine.add_request("next", turn, greedy(24))
        out = drain(engine).choices["next"][0]
        answers[caching], cached[caching] = out.token_ids, out.num_cached_tokens
    assert cached[True] == len(chat) // BLOCK_SIZE * BLOCK_SIZE > 0  # the prompt's blocks only
    assert answers[True] == answers[False]
