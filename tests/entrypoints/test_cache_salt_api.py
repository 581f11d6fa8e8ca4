"""vLLM's ``cache_salt`` over HTTP: a salted request's prefix-cache hits come only from
requests with the same salt (the answer is the same); a malformed salt is a 400 naming it."""

from __future__ import annotations

import httpx

from tests.support.api import assert_error


def test_cache_salt_isolates_the_prefix_cache_and_bad_salts_are_400(server):
    words = " ".join(f"item{i}" for i in range(60))
    body = {"messages": [{"role": "user", "content": f"Repeat: {words}"}], "max_tokens": 4,
            "temperature": 0}  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=60) as c:

        def cached(salt):
            r = c.post("/v1/chat/completions", json={**body, "cache_salt": salt})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), r.json()

        first, answer = cached("tenant-a")
        other, answer_b = cached("tenant-b")
        again, _ = cached("tenant-a")
        assert other == 0 and again > 0
        assert answer["choices"][0]["message"] == answer_b["choices"][0]["message"]
        for bad in ("", 5, ["a"]):
            r = c.post("/v1/chat/completions", json={**body, "cache_salt": bad})
            assert_error(r, 400, "cache_salt")
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "cache_salt": ""})
        assert_error(r, 400, "cache_salt")
        r = c.post("/v1/responses", json={"input": "Hi", "cache_salt": "x"})
        assert_error(r, 400, "cache_salt")
