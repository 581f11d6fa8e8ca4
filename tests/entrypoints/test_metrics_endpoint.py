"""/metrics: Prometheus text that parses, with vLLM's names under tinyserve:."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "tinyserve:prompt_tokens", "tinyserve:generation_tokens", "tinyserve:prefix_cache_queries",
    "tinyserve:prefix_cache_hits", "tinyserve:num_preemptions",
}  # fmt: skip
GAUGES = {
    "tinyserve:num_requests_running", "tinyserve:num_requests_waiting",
    "tinyserve:kv_cache_usage_perc",
}  # fmt: skip
HISTOGRAMS = {
    "tinyserve:time_to_first_token_seconds", "tinyserve:inter_token_latency_seconds",
    "tinyserve:e2e_request_latency_seconds",
}  # fmt: skip


def scrape(client) -> dict[str, dict[str, float]]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(r.text):
        out[fam.name] = {"type": fam.type}
        for sample in fam.samples:
            out[fam.name][sample.name] = sample.value
    return out


def test_metrics_parse_and_move(client):
    before = scrape(client)
    for name in COUNTERS:
        assert before[name]["type"] == "counter"
    for name in GAUGES:
        assert before[name]["type"] == "gauge"
    for name in HISTOGRAMS:
        assert before[name]["type"] == "histogram"
    body = {"prompt": "Metrics are", "max_tokens": 4, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json=body).status_code == 200  # a prefix-cache hit
    after = scrape(client)

    def value(snap, name, suffix):
        return snap[name].get(name + suffix, 0.0)

    assert value(after, "tinyserve:generation_tokens", "_total") >= (
        value(before, "tinyserve:generation_tokens", "_total") + 8
    )
    assert value(after, "tinyserve:prompt_tokens", "_total") > value(
        before, "tinyserve:prompt_tokens", "_total"
    )
    assert value(after, "tinyserve:prefix_cache_queries", "_total") > value(
        before, "tinyserve:prefix_cache_queries", "_total"
    )
    for name in HISTOGRAMS:
        assert value(after, name, "_count") >= value(before, name, "_count") + 2 - (
            name == "tinyserve:inter_token_latency_seconds"
        )
    assert after["tinyserve:num_requests_running"]["tinyserve:num_requests_running"] == 0
    assert 0.0 <= after["tinyserve:kv_cache_usage_perc"]["tinyserve:kv_cache_usage_perc"] <= 1.0
