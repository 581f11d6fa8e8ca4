"""The grammar seam against references: masks vs accepting tokens one by one, EOS only where
the grammar may end, rejection leaves the state alone, rollback, bitmask application, and
compile errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from tinyserve.entrypoints.structured_options import PRETTY
from tinyserve.structured.backend import GrammarBackend
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.worker.sampler import apply_grammar_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
DOC = '{"name": "ab", "n": 12, "tags": ["x"]}'


def _bits(bitmask, row=0):
    return ((bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()


def _allowed(bitmask, row=0) -> set[int]:
    return set(_bits(bitmask, row).nonzero().flatten().tolist())


@pytest.fixture(scope="module")
def compiled(backend):
    return backend.compile(StructuredOutputSpec.json_schema(SCHEMA))


@pytest.fixture(scope="module")
def doc_ids(smollm2_tokenizer):
    return smollm2_tokenizer.encode(DOC, add_special_tokens=False)


@pytest.mark.parametrize("position", [0, 1, 3, 5, 9, "end"])
def test_mask_equals_tokens_accepted_one_by_one(
    backend, compiled, doc_ids, smollm2_tokenizer, position
):
    """Over the whole vocabulary: a bit is set exactly where accept_tokens([t]) succeeds,
    except where the grammar forces the next bytes (a property name): there llguidance
    allows only the token that spells them whole, and accept_tokens also takes the tokens
    that spell a strict prefix of them (sampling never needs those)."""
    k = len(doc_ids) if position == "end" else position
    matcher = backend.matcher(compiled)
    assert matcher.accept_tokens(doc_ids[:k])
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    reference = set()
    for t in range(backend.vocab_size):
        if matcher.accept_tokens([t]):
            reference.add(t)
            matcher.rollback(1)
    allowed = _allowed(bitmask)
    assert allowed and allowed <= reference
    forced = matcher._m.compute_ff_bytes().decode()  # llguidance's forced bytes, for the check
    for t in reference - allowed:
        text = smollm2_tokenizer.decode([t])
        assert forced.startswith(text) and len(text) < len(forced), (t, text, forced)


def test_eos_only_where_the_grammar_may_end(backend, compiled, doc_ids):
    eos = backend.eos_token_ids[0]
    matcher = backend.matcher(compiled)
    bitmask = backend.allocate_bitmask(1)
    for k, t in enumerate(doc_ids):
        matcher.fill_bitmask(bitmask, 0)
        assert eos not in _allowed(bitmask), k
        assert not matcher.accept_tokens([eos])
        assert matcher.accept_tokens([t])
    matcher.fill_bitmask(bitmask, 0)
    assert eos in _allowed(bitmask)
    assert matcher.accept_tokens([eos]) and matcher.is_terminated()
    matcher.fill_bitmask(bitmask, 0)
    assert _allowed(bitmask) == {eos}


def test_rejected_tokens_leave_the_state_unchanged(backend, compiled, doc_ids, smollm2_tokenizer):
    matcher = backend.matcher(compiled)
    assert matcher.accept_tokens(doc_ids[:3])
    before, after = backend.allocate_bitmask(1), backend.allocate_bitmask(1)
    matcher.fill_bitmask(before, 0)
    bad = smollm2_tokenizer.encode("}", add_special_tokens=False)
    assert not matcher.accept_tokens(bad)
    assert not matcher.accept_tokens([doc_ids[3], backend.eos_token_ids[0]])  # all or nothing
    assert not matcher.accept_tokens([backend.vocab_size + 5, -1])
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.accept_tokens(doc_ids[3:5])


def test_rollback_and_reset_restore_earlier_states(backend, compiled, doc_ids):
    matcher = backend.matcher(compiled)
    at1, now = backend.allocate_bitmask(1), backend.allocate_bitmask(1)
    assert matcher.accept_tokens(doc_ids[:1])
    matcher.fill_bitmask(at1, 0)
    assert matcher.accept_tokens(doc_ids[1:4])
    matcher.rollback(3)
    matcher.fill_bitmask(now, 0)
    assert torch.equal(at1, now)
    matcher.reset()
    assert matcher.accept_tokens(doc_ids) and matcher.is_terminated()  # nothing after "}"
    other = backend.matcher(compiled)  # matchers from one compiled grammar are independent
    assert other.accept_tokens(doc_ids[:1])


# "a" allows no value (A refers only to itself): the grammar compiles, and its matcher reaches
# a state nothing can extend once `{"a":` is written (the bug hunt's tool schema).
DEAD_END = {"$defs": {"A": {"$ref": "#/$defs/A"}}, "type": "object",
            "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}  # fmt: skip


def test_rollback_out_of_a_dead_end(backend, smollm2_tokenizer):
    """Speculative drafts walked into a state with no continuation: the library's matcher is
    then in an error state and refuses to roll back (the engine thread died on the
    ValueError). The matcher is rebuilt from its accepted tokens instead: the state before
    the drafts again, its mask unchanged; the dead end itself still allows only EOS."""
    matcher = backend.matcher(backend.compile(StructuredOutputSpec.json_schema(DEAD_END)))
    forced = matcher.forced_tokens()
    assert smollm2_tokenizer.decode(forced).replace(" ", "").startswith('{"a":')
    head, rest = forced[:2], forced[2:]
    assert matcher.accept_tokens(head)
    before, after, dead = (backend.allocate_bitmask(1) for _ in range(3))
    matcher.fill_bitmask(before, 0)
    assert matcher.accept_tokens(rest)
    matcher.fill_bitmask(dead, 0)
    assert matcher.error() and _allowed(dead) <= set(backend.eos_token_ids)
    matcher.rollback(len(rest))
    assert not matcher.error()
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.accept_tokens(rest)  # and the same way on, as before the drafts


def test_choice_prefix_may_end_or_go_on(backend, smollm2_tokenizer):
    compiled = backend.compile(StructuredOutputSpec.choice(["ab", "abc"]))
    matcher = backend.matcher(compiled)
    assert matcher.accept_tokens(smollm2_tokenizer.encode("ab", add_special_tokens=False))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    allowed = _allowed(bitmask)
    assert backend.eos_token_ids[0] in allowed and len(allowed) > 1


def test_bits_past_the_tokenizer_are_zero_and_masked(smollm2_tokenizer):
    width = len(smollm2_tokenizer) + 40  # a model whose logits are padded past the vocab
    wide = GrammarBackend(smollm2_tokenizer, vocab_size=width)
    matcher = wide.matcher(wide.compile(StructuredOutputSpec.regex(r"[a-z ]+")))
    bitmask = wide.allocate_bitmask(2)
    assert bitmask.shape == (2, (width + 31) // 32) and bitmask.dtype == torch.int32
    matcher.fill_bitmask(bitmask, 1)
    assert _bits(bitmask, 1)[len(smollm2_tokenizer) :].sum() == 0
    logits = torch.zeros(3, width)
    apply_grammar_bitmask(logits, torch.tensor([2]), bitmask[1:])
    assert torch.isinf(logits[2, len(smollm2_tokenizer) :]).all()
    assert not torch.isinf(logits[:2]).any()


def test_apply_bitmask_matches_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(4, vocab, generator=gen)
    expected = logits.clone()
    for i, row in enumerate([3, 1]):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_grammar_bitmask(logits, torch.tensor([3, 1]), bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            StructuredOutputSpec.json_schema({"$dynamicRef": "#x"}),
            "response_format: unsupported JSON schema keyword '$dynamicRef'",
        ),
        (
            StructuredOutputSpec.json_schema({"$dynamicRef": "#x", "$recursiveRef": "#"}),
            "response_format: unsupported JSON schema keywords '$dynamicRef', '$recursiveRef'",
        ),
        (
            StructuredOutputSpec.json_schema({"$ref": "#/$defs/missing"}),
            "response_format: invalid JSON schema: Pointer '/$defs/missing' does not exist",
        ),
        (
            StructuredOutputSpec.json_schema({"type": "string", "pattern": "(a"}),
            "response_format: invalid JSON schema: regex parse error",
        ),
        (  # JSON Schema: strictly greater than 0 (the library took -2 and generated)
            StructuredOutputSpec.json_schema({"type": "number", "multipleOf": -2}),
            "response_format: invalid JSON schema: multipleOf must be greater than 0",
        ),
        (
            StructuredOutputSpec.regex("(a", field="structured_outputs.regex"),
            "structured_outputs.regex: invalid regex",
        ),
        (
            StructuredOutputSpec.grammar("start: undefined_rule", field="grammar"),
            "grammar: invalid grammar",
        ),
    ],  # fmt: skip
)
def test_compile_errors_name_the_field_and_the_keyword(backend, spec, message):
    with pytest.raises(ValueError) as err:
        backend.compile(spec)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [f"value-{i}" for i in range(2000)]},  # a large enum
        {
            "$ref": "#/$defs/d0",
            "$defs": {
                f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                for i in range(40)
            }
            | {"d40": {"type": "null"}},
        },
        {"type": "object", "properties": {"self": {"$ref": "#"}, "v": {"type": "integer"}}},
        {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    ],  # fmt: skip
    ids=["enum2000", "deep40", "self_ref_root", "patternProperties", "prefixItems"],
)
def test_real_world_schemas_compile_or_refuse_cleanly(backend, schema):
    try:
        compiled = backend.compile(StructuredOutputSpec.json_schema(schema))
    except ValueError as e:
        assert str(e).startswith("response_format: "), str(e)
        return
    bitmask = backend.allocate_bitmask(1)
    backend.matcher(compiled).fill_bitmask(bitmask, 0)
    assert _bits(bitmask).any()


@pytest.mark.parametrize("text, choices", [("ab", ["ab", "abc"]), ("abc", ["ab", "abc"])])
def test_rollback_of_eos_restores_the_state_before_it(backend, smollm2_tokenizer, text, choices):
    """EOS accepted where the grammar may go on ("ab") or is already stopped ("abc"), then
    rolled back: the state is the one before the EOS, not one token earlier."""
    matcher = backend.matcher(backend.compile(StructuredOutputSpec.choice(choices)))
    assert matcher.accept_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False))
    before, after = backend.allocate_bitmask(1), backend.allocate_bitmask(1)
    matcher.fill_bitmask(before, 0)
    eos = backend.eos_token_ids[0]
    assert matcher.accept_tokens([eos]) and matcher.is_terminated()
    matcher.rollback(1)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.accept_tokens([eos]) and matcher.is_terminated()


def test_forced_tokens_spell_what_the_grammar_allows_alone(backend, compiled, smollm2_tokenizer):
    """Fast-forward: from the start SCHEMA forces '{"name": "' (its first property is
    required); inside the free string nothing is forced; each forced token is the only one
    its mask allows; after the end nothing."""
    m = backend.matcher(compiled)
    forced = m.forced_tokens()
    assert forced and '{"name": "'.startswith(smollm2_tokenizer.decode(forced))
    bitmask = backend.allocate_bitmask(1)
    for t in forced:
        m.fill_bitmask(bitmask, 0)
        assert _allowed(bitmask) == {t}
        assert m.accept_tokens([t])
    m.reset()
    assert m.accept_tokens(smollm2_tokenizer.encode('{"name": "a', add_special_tokens=False))
    assert m.forced_tokens() == []
    m.reset()
    assert m.accept_tokens(smollm2_tokenizer.encode(DOC, add_special_tokens=False))
    assert m.accept_tokens([backend.eos_token_ids[0]]) and m.forced_tokens() == []


def test_the_grammar_backend_does_not_load_torch_dynamo():
    """llguidance.torch wraps a helper in torch.compile at import, which loads torch._dynamo
    (~3.4 s of a server's start): the backend fills masks without it."""
    import subprocess
    import sys

    code = ("import sys, tinyserve.structured.backend as b; "
            "print('torch._dynamo' in sys.modules, 'llguidance.torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _takes(backend, compiled, text: str, tokenizer) -> bool:
    """Whether the grammar takes ``text`` whole and may end after it."""
    m = backend.matcher(compiled)
    return m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.accept_tokens(
        [backend.eos_token_ids[0]]
    )


def test_json_layout_is_one_line_and_pretty_is_bounded(backend, compiled, smollm2_tokenizer):
    """The default layout (issue 39) is json.dumps's one-line form; the --json-pretty layout
    takes that, its indent=2 form and the bare one, and refuses runs of whitespace an answer
    could pad itself with (two newlines, 2 spaces, 41 spaces of indent) and whitespace
    before the first bracket or after the last."""
    value = json.loads(DOC)
    assert _takes(backend, compiled, DOC, smollm2_tokenizer)
    assert not _takes(backend, compiled, json.dumps(value, indent=2), smollm2_tokenizer)
    pretty = backend.compile(StructuredOutputSpec.json_schema({**SCHEMA, "x-guidance": PRETTY}))
    for text in (DOC, json.dumps(value, indent=2), json.dumps(value, separators=(",", ":"))):
        assert _takes(backend, pretty, text, smollm2_tokenizer), text
    for text in ('{\n\n  "name": "ab", "n": 12, "tags": ["x"]}',
                 '{' + " " * 2 + '"name": "ab", "n": 12, "tags": ["x"]}',
                 '{\n' + " " * 41 + '"name": "ab", "n": 12, "tags": ["x"]}',
                 ' ' + DOC, DOC + "\n"):  # fmt: skip
        assert not _takes(backend, pretty, text, smollm2_tokenizer), text
