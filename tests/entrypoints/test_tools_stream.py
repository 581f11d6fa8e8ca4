"""The streamed tool-call parsers (entrypoints/tool_stream.py) against the non-streamed ones
(tools.parse_output / parse_native): on many random outputs cut into random pieces, the deltas
add up to the same content and calls, with OpenAI's chunk shape."""

from __future__ import annotations

import json
import random
from functools import partial

import pytest

from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.tool_formats import WholeAnswer
from tinyserve.entrypoints.tool_stream import (
    EnvelopeStream,
    HermesStream,
    JsonScanner,
    StopAtText,
    feed,
    unarmed_chars,
)
from tinyserve.testing.server import wait_until

TEXT_BITS = ["a", " ", "\n", "  ", "<", "<tool", "<tool_", "tool_call>", "</tool_call>", "é",
             "😀", '"', "\\", "{", "}", "Sure.", "<tool_cal", "\t", "x<tool_callx"]  # fmt: skip
STR_BITS = ["a", "é", "😀", '"', "\\", "\n", "\t", "\x01", "\ud800", "</tool_call>", " ", "/"]


def _string(rng: random.Random) -> str:
    return "".join(rng.choice(STR_BITS) for _ in range(rng.randrange(8)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return _string(rng)
    if kind == 1:
        return rng.choice([0, -3, 2.5, 1e21, 12345678901234567890])
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return None
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_string(rng): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _dumps(rng: random.Random, value) -> str:
    indent = rng.choice([None, None, 2, 0])
    seps = rng.choice([(", ", ": "), (",", ":"), (" ,  ", " :\n")])
    return json.dumps(value, indent=indent, separators=seps, ensure_ascii=rng.random() < 0.5)


def _call(rng: random.Random) -> dict:
    args = {_string(rng) or "k": _value(rng) for _ in range(rng.randrange(4))}
    call = {"name": rng.choice(["get_weather", "f", "a-b_c"]), "arguments": args}
    return dict(reversed(call.items())) if rng.random() < 0.2 else call  # arguments first


def envelope(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return _dumps(rng, {"content": _string(rng)})
    return _dumps(rng, {"tool_calls": [_call(rng) for _ in range(rng.randint(1, 3))]})


def envelope_json(rng: random.Random) -> str:
    """A response format beside the tools: the content is any JSON value (its text)."""
    if rng.random() < 0.4:
        return _dumps(rng, {"content": _value(rng)})
    return envelope(rng)


def hermes(rng: random.Random) -> str:
    def text() -> str:
        return "".join(rng.choice(TEXT_BITS) for _ in range(rng.randrange(6)))

    parts = [text()]
    for _ in range(rng.randrange(4)):
        ws = [rng.choice(["", "\n", " \n", "\n\n"]) for _ in range(4)]
        parts.append(f"{ws[0]}<tool_call>{ws[1]}{_dumps(rng, _call(rng))}{ws[2]}</tool_call>")
        parts.append(ws[3] + (text() if rng.random() < 0.3 else ""))
    return "".join(parts)


def streamed(parser, text: str, rng: random.Random, finish: str = "stop"):
    """Feed ``text`` in random pieces; the chunks' deltas accumulated as the SDK does."""
    events, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        events += parser.feed(text[i : i + n])
        i += n
    events += parser.finish(finish)
    content, calls, fragments = "", {}, {}
    for delta, reason in events[:-1]:
        assert reason is None
        content += delta.get("content", "")
        entries = delta.get("tool_calls", [])
        assert len(entries) <= 1 and (entries or delta.get("content"))
        for e in entries:
            if "id" in e:  # the first delta of a call
                assert e["index"] not in calls and e["index"] == len(calls)
                assert e["type"] == "function" and e["function"]["arguments"] == ""
                calls[e["index"]] = [e["function"]["name"], ""]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                calls[e["index"]][1] += e["function"]["arguments"]
                fragments[e["index"]] = fragments.get(e["index"], 0) + 1
    assert events[-1][0] == {}
    return content, [tuple(calls[i]) for i in sorted(calls)], events[-1][1], fragments


@pytest.mark.parametrize(
    "make, stream, parse",
    [(envelope, EnvelopeStream, T.parse_output), (hermes, HermesStream, T.parse_native),
     (envelope_json, partial(EnvelopeStream, True), partial(T.parse_output, json_answer=True))],
)  # fmt: skip
def test_streamed_deltas_add_up_to_the_non_streamed_parse(make, stream, parse):
    rng = random.Random(0)
    seen_calls = seen_text = long_calls = fragmented = 0
    for _ in range(600):
        text = make(rng)
        want_content, want_calls = parse(text)
        content, calls, finish, fragments = streamed(stream(), text, rng)
        assert (content or None) == (want_content or None), text
        assert calls == [(c.function.name, c.function.arguments) for c in want_calls], text
        assert finish == ("tool_calls" if want_calls else "stop")
        if want_calls:
            seen_calls += 1
            # (text may hold a tag that does not begin a call: it stays content)
            assert "<tool_call>" not in content or text.count("<tool_call>") > len(calls)
            # Arguments stream as generated (not when they come before the name: held).
            long = [i for i, (_, args) in enumerate(calls) if len(args) > 20]
            long_calls += len(long)
            fragmented += sum(fragments[i] > 1 for i in long)
        else:
            seen_text += 1
    assert seen_calls > 100 and seen_text > 50 and fragmented > 0.6 * long_calls > 50


def test_a_tag_prefix_is_held_back_until_it_is_known():
    p = HermesStream()
    assert p.feed("Hello <tool") == [({"content": "Hello"}, None)]  # " <tool" may be the tag
    assert p.feed("s>") == [({"content": " <tools>"}, None)]
    assert p.feed("\n<tool_call>\n{") == []
    assert p.feed('"name": "f"')[0][0]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": "",
    }
    p = HermesStream()
    assert p.feed("cut <tool_c") == [({"content": "cut"}, None)]
    assert p.finish("length") == [({"content": " <tool_c"}, None), ({}, "length")]


def test_a_block_that_ends_the_output_is_closed():
    text = '<tool_call>\n{"name": "f"}\n</tool_call>'  # no arguments: {} as not streamed
    events = HermesStream().feed(text)
    assert [d["tool_calls"][0]["function"]["arguments"] for d, _ in events] == ["", "{}"]
    p = HermesStream()
    p.feed(text)
    assert p.finish("stop") == [({}, "tool_calls")]
    assert T.parse_native(text)[1][0].function.arguments == "{}"


@pytest.mark.parametrize("stream, text", [
    (EnvelopeStream, '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g'),
    (HermesStream, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "g'),
])  # fmt: skip
@pytest.mark.parametrize("reason", ["length", "stop"])  # stop: a stop string mid-call
def test_a_finish_mid_call_keeps_what_was_sent(stream, text, reason):
    content, calls, finish, _ = streamed(stream(), text, random.Random(1), finish=reason)
    assert finish == reason and content == ""  # not tool_calls: the last call is cut
    assert calls == [("f", '{"a": 1}')]  # g's name never completed: no entry for it


def test_scanner_decodes_strings_and_reports_raw_spans():
    doc = {"k\u00e9": ['\ud83d\ude00\\"\n\ud800x', {"n": [1.5e3, None, True]}], "": {}}
    text = json.dumps(doc, ensure_ascii=True, indent=1) + " trailing"
    s, events = JsonScanner(), []
    for ch in text:
        events += s.feed(ch)[0]
    assert s.done and not s.error
    decoded = "".join(p for kind, path, p in events if kind == "str" and path == ("k\u00e9", 0))
    value = json.loads(text.removesuffix(" trailing"))
    assert decoded == value["k\u00e9"][0] and "\U0001f600" in decoded
    raw = "".join(p for kind, path, p in events if kind == "raw" and path[:2] == ("k\u00e9", 1))
    assert json.loads(raw) == value["k\u00e9"][1] and raw == raw.strip()
    ends = [path for kind, path, _ in events if kind == "end"]
    assert ends[-1] == () and ("",) in ends and ("k\u00e9", 1, "n", 2) in ends
    assert JsonScanner().feed('{"a" 1}')[1] == 5  # stops at the error


@pytest.mark.parametrize("stream", [EnvelopeStream, HermesStream])
def test_garbage_never_raises(stream):
    """Text no grammar would allow (a server bug, a stop string mid-call) must not break
    the stream: the parsers take anything and still end with a finish event."""
    rng = random.Random(2)
    bits = list('{}[]":,\\ \nu0123456789abcdeE.-tnrl') + ["<tool_call>", "</tool_call>",
            '"name"', '"arguments"', '"tool_calls"', '"content"', "\\ud83d", "é"]  # fmt: skip
    starts = ['{"tool_calls": [{"name": "f", "arguments": ', '<tool_call>\n{"name": "f", ', ""]
    for _ in range(1500):
        text = rng.choice(starts) + "".join(rng.choice(bits) for _ in range(rng.randrange(40)))
        finish = rng.choice(["stop", "length"])
        _, _, reason, _ = streamed(stream(), text, rng, finish)
        assert reason in (finish, "tool_calls")


@pytest.mark.parametrize("stream", [EnvelopeStream, HermesStream])
def test_stop_strings_end_the_text_the_client_sees_not_the_wrapper(stream):
    """Stop strings with tools match the answer's text (StopAtText), fed in random pieces:
    in the envelope a stop on ``}`` or ``"`` hit the wrapper (an answer cut before its first
    word), and one inside the text matched its JSON escape, not the text."""
    rng = random.Random(1)
    call = '{"name": "f", "arguments": {"s": "a}b\\"c"}}'
    answers = {EnvelopeStream: ('{"content": "Say \\"hi\\" to 2 + 2 = 4."}',
                                '{"tool_calls": [' + call + "]}"),
               HermesStream: ('Say "hi" to 2 + 2 = 4.', f"<tool_call>{call}</tool_call>")}  # fmt: skip
    text, calls = answers[stream]
    cases = [(["}"], 'Say "hi" to 2 + 2 = 4.', None, "stop"),
             (['"'], "Say ", '"', "stop"), (["2 = ", "= 4"], 'Say "hi" to 2 + ', "2 = ", "stop"),
             (['i" t'], 'Say "h', 'i" t', "stop")]  # fmt: skip
    for stops, want, stop, finish in cases:
        for include in (False, True):
            for _ in range(20):
                parser = StopAtText(stream(), stops, include)
                content, got_calls, got_finish, _ = streamed(parser, text, rng)
                expect = want + (stop if include and stop else "")
                assert (content, got_calls, got_finish) == (expect, [], finish), (stops, include)
                assert parser.stop_reason == stop
    if stream is HermesStream:  # text after complete calls: a stop there still says tool_calls
        parser = StopAtText(stream(), ["."])
        content, got_calls, got_finish, _ = streamed(parser, calls + "\nDone. ok", rng)
        assert (content, got_finish, parser.stop_reason) == ("Done", "tool_calls", ".")
        assert got_calls == [("f", '{"s": "a}b\\"c"}')]
    for _ in range(20):  # a call's JSON is not text: its braces and quotes stop nothing
        parser = StopAtText(stream(), ["}", '"'])
        content, got_calls, got_finish, _ = streamed(parser, calls, rng)
        assert got_calls == [("f", '{"s": "a}b\\"c"}')] and got_finish == "tool_calls"
        assert parser.stop_reason is None and not content


def test_stop_sequences_with_tools_served(fake_server):
    """Through the server (the fake engine matches stop strings on the raw text as the
    engine does): chat, streamed and not, and Anthropic's Messages API."""
    import httpx

    script = ['{"content": "', "2 + 2", " = 4", '."}', " ", " "]  # (trailing steps: to abort)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "hi"}]
    with (
        fake_server(script=script, step_delay=0.05) as s,
        httpx.Client(base_url=s.base_url, timeout=30) as c,
    ):
        body = {"model": "fake-model", "messages": msgs, "tools": [tool], "max_tokens": 8}
        for stop, content, reason in (["}"], "2 + 2 = 4.", None), (['"'], "2 + 2 = 4.", None), (
                ["= "], "2 + 2 ", "= "):  # fmt: skip
            aborted = len(s.engine.aborted)
            answer = c.post("/v1/chat/completions", json={**body, "stop": stop}).json()
            choice = answer["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (content, "stop")
            assert choice["stop_reason"] == reason
            # a stop of the text ends the request there (aborted: the 6-piece script's 3),
            # not after the envelope (or the context: a looping model ran 142 s)
            want = aborted + (reason is not None)
            assert wait_until(lambda want=want: len(s.engine.aborted) == want)
            assert answer["usage"]["completion_tokens"] == (3 if reason else 6)
            aborted = len(s.engine.aborted)
            with c.stream("POST", "/v1/chat/completions", json={
                    **body, "stop": stop, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:  # fmt: skip
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            *chunks, usage = chunks
            text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
            finishes = [ch["choices"][0]["finish_reason"] for ch in chunks]
            assert text == content and finishes.count("stop") == 1, (stop, chunks)
            assert chunks[-1]["choices"][0]["stop_reason"] == reason
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 3
            # a stop of the text ends the stream and the request at once (it is aborted)
            want = aborted + (reason is not None)
            assert wait_until(lambda want=want: len(s.engine.aborted) == want)
            anthropic_body = {"model": "fake-model", "max_tokens": 8, "messages": msgs,
                              "stop_sequences": stop, "tools": [
                                  {"name": "f", "input_schema": {"type": "object"}}]}  # fmt: skip
            m = c.post("/v1/messages", json=anthropic_body).json()
            assert m["content"] == [{"type": "text", "text": content}], m
            assert (m["stop_reason"], m["stop_sequence"]) == (
                ("stop_sequence", reason) if reason else ("end_turn", None)
            )
            aborted = len(s.engine.aborted)
            with c.stream("POST", "/v1/messages", json={**anthropic_body, "stream": True}) as r:
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
            delta = next(e for e in events if e["type"] == "message_delta")
            assert (
                delta["delta"]["stop_sequence"] == reason and events[-1]["type"] == "message_stop"
            )
            assert delta["usage"]["output_tokens"] >= 3
            want = aborted + (reason is not None)
            assert wait_until(lambda want=want: len(s.engine.aborted) == want)
        # a stop at the text's start: content "" as without tools (it was null)
        choice = c.post("/v1/chat/completions", json={**body, "stop": ["2 +"]}).json()["choices"][0]
        assert (choice["message"]["content"], choice["message"].get("tool_calls")) == ("", None)
        assert choice["finish_reason"] == "stop"


def test_a_streamed_response_with_tools_ends_at_a_stop_of_its_text(fake_server):
    """/v1/responses streamed, with tools and a stop string its text meets: the response
    completes there and the request is aborted (it ran on to the answer's end, unseen)."""
    import httpx

    script = ['{"content": "', "2 + 2", " = 4", '."}', " ", " "]
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {"model": "fake-model", "input": "hi", "tools": [tool], "max_output_tokens": 8,
            "stop": ["= "], "stream": True}  # fmt: skip
    with (
        fake_server(script=script, step_delay=0.05) as s,
        httpx.Client(base_url=s.base_url, timeout=30) as c,
        c.stream("POST", "/v1/responses", json=body) as r,
    ):
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
        done = events[-1]
        assert done["type"] == "response.completed", done
        assert done["response"]["output"][0]["content"][0]["text"] == "2 + 2 "
        assert done["response"]["usage"]["output_tokens"] == 3
        assert wait_until(lambda: len(s.engine.aborted) == 1)


def test_text_before_min_tokens_is_not_stopped():
    """StopAtText fed with ``armed`` false (StepOutput.armed_from: the first min_tokens output
    tokens) passes the text unmatched and unheld; armed, it stops as before."""
    for stream, text in (
        (EnvelopeStream, '{"content": "2 + 2 = 4."}'),
        (HermesStream, "2 + 2 = 4."),
    ):
        head, tail = text[: text.index("+") + 2], text[text.index("+") + 2 :]
        parser = StopAtText(stream(), ["2"])
        events = parser.feed(head, armed=False)
        seen = "".join(d.get("content", "") for d, _ in events)  # (a parser may hold a space)
        assert seen.startswith("2 +") and parser.stop_reason is None
        events += parser.feed(tail)
        assert events[-1] == ({}, "stop") and parser.stop_reason == "2"
        assert "".join(d.get("content", "") for d, _ in events) == "2 + "


def test_min_tokens_holds_back_the_stop_strings_of_an_answer_with_tools(fake_server):
    """Served, with tools (stop strings match the text: StopAtText), a stop string counts
    only past the first min_tokens output tokens, as without tools: chat and the Responses
    API, streamed and not (Anthropic's Messages API has no min_tokens)."""
    import httpx

    script = ['{"content": "', "2 + 2", " = 4", '."}']  # a token each
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "hi"}]
    # stop "2" meets the text in the 2nd token: with min_tokens 2 it does not count there
    cases = [(["2"], 0, ""), (["2"], 1, ""), (["2"], 2, "2 + 2 = 4."), (["4"], 2, "2 + 2 = ")]
    with (
        fake_server(script=script) as s,
        httpx.Client(base_url=s.base_url, timeout=30) as c,
    ):
        for stop, min_tokens, want in cases:
            body = {"model": "fake-model", "messages": msgs, "tools": [tool], "max_tokens": 8,
                    "stop": stop, "min_tokens": min_tokens}  # fmt: skip
            choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
            assert choice["message"]["content"] == want, (stop, min_tokens, choice)
            with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
            assert text == want, (stop, min_tokens, chunks)
            rbody = {"model": "fake-model", "input": "hi", "max_output_tokens": 8, "stop": stop,
                     "min_tokens": min_tokens, "tools": [{"type": "function", "name": "f",
                     "parameters": {"type": "object"}}]}  # fmt: skip
            r = c.post("/v1/responses", json=rbody).json()
            got = "".join(p["text"] for o in r["output"] for p in o.get("content", []))
            assert got == want, (stop, min_tokens, r)
            with c.stream("POST", "/v1/responses", json={**rbody, "stream": True}) as r:
                done = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")][-1]
            out = done["response"]["output"]
            assert "".join(p["text"] for o in out for p in o.get("content", [])) == want


def test_content_an_unarmed_feed_left_held_is_not_stopped_later():
    """What the inner parser held back from text fed unarmed (Hermes's trailing whitespace,
    the envelope's half escape, a whole answer read at its end) passes unmatched when it is
    given later; text after it is matched as before."""
    cases = [(HermesStream(), [("Hello\n", 0), ("World\nmore", 1)], ["\n"], "Hello\nWorld"),
             (EnvelopeStream(), [('{"content": "a\\', 0), ('nb\\nc"}', 1)], ["\n"], "a\nb"),
             (WholeAnswer(None, ["f"]), [("2 + ", 0), ("2 = 4.", 1)], ["2"], "2 + ")]  # fmt: skip
    for inner, pieces, stops, want in cases:
        parser = StopAtText(inner, stops)
        events = [e for text, armed in pieces for e in parser.feed(text, bool(armed))]
        events += parser.finish("stop")
        assert "".join(d.get("content", "") for d, _ in events) == want, (inner, events)


def test_a_speculative_run_crossing_min_tokens_is_armed_from_its_token():
    """A step of several tokens (a verified draft run) that crosses min_tokens: stop strings
    count from the text of the first token past min_tokens on (StepOutput.armed_from), as
    the detokenizer counts them without tools (and vLLM: len(output) > min_tokens)."""
    from tinyserve.engine.output_processor import OutputProcessor
    from tinyserve.outputs import ModelRunnerOutput
    from tinyserve.sampling_params import SamplingParams

    pieces = {1: "a", 2: "X", 3: "b", 4: "c", 9: "p"}

    class Tok:
        def decode(self, ids, **kw):
            return "".join(pieces[i] for i in ids)

    def run(stop, steps=([1], [2, 3, 4])):
        proc = OutputProcessor(Tok(), (), max_model_len=64)
        params = SamplingParams(max_tokens=8, min_tokens=3, stop=stop)
        (req,) = proc.add_request("r", [[9, 9]], params, 0.0)
        outs = []
        for ids in steps:
            for t in ids:
                req.append_output_token(t)
            outs += proc.process([req], ModelRunnerOutput(sampled_token_ids={"r": ids})).outputs
        return outs

    plain = "".join(o.text_delta for o in run(["X", "c"]))  # the detokenizer's own stops
    outs = run([])  # with tools the stops leave the engine's params (serving.Job)
    assert [o.armed_from for o in outs] == [None, 2]  # "Xb": the 2nd and 3rd tokens
    for stops in (["X"], ["c"]):
        parser = StopAtText(HermesStream(), stops)
        events = [e for o in outs for e in feed(parser, o.text_delta, unarmed_chars(o))]
        events += parser.finish("length") if parser.stop_reason is None else []
        text = "".join(d.get("content", "") for d, _ in events)
        assert text == ("aXbc" if stops == ["X"] else "aXb"), stops
    assert plain == "aXb"  # (the X did not count there either; the c did)


def test_held_text_that_never_became_content_leaves_the_unarmed_budget():
    """Whitespace Hermes held from an unarmed feed and then dropped (a call followed it):
    the first characters of content after the call are matched again, not skipped."""
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser = StopAtText(HermesStream(), ["X"])
    events = parser.feed("Hi \n", armed=False) + parser.feed(call) + parser.feed("X and more")
    assert parser.stop_reason == "X", events
