"""Take the README's screenshots of the playground and its engine view.

Serves the default model in-process, opens ``/`` in headless Chromium, asks one question in
the chat while eight other clients stream answers that share a long system prompt (so the
KV pool shows shared prefix blocks), and saves, mid-run:

    docs/images/playground.png    the whole page
    docs/images/engine_view.png   the engine panel alone

Usage: python scripts/playground_screenshots.py [--out docs/images]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import httpx
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tinyserve.config import ServerConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.testing.browser import start_browser
from tinyserve.testing.server import serve, wait_until

SYSTEM = (
    "You are a patient teacher of computer science. Answer in plain words, with one short "
    "example, and never more than a few sentences. " * 6
)
QUESTIONS = [
    "What is a hash table?",
    "What does a compiler do?",
    "Why do CPUs have caches?",
    "What is a mutex?",
    "What is recursion?",
    "What is a linked list?",
    "What is TCP?",
    "What is a GPU good at?",
]


def background_load(base_url: str, model: str) -> list[threading.Thread]:
    def ask(question: str) -> None:
        body = {
            "model": model,
            "max_tokens": 160,
            "stream": True,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
        }
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=ask, args=(q,), daemon=True) for q in QUESTIONS]
    for t in threads:
        t.start()
        time.sleep(0.3)  # staggered: prefill chunks and decode rows share steps
    return threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/images")
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(EngineArgs(kv_cache_memory="64MiB", max_num_seqs=16))
    with serve(AsyncEngine(engine), ServerConfig()) as server:
        browser = start_browser(1500, 950)
        try:
            browser.get(server.base_url + "/")
            assert wait_until(lambda: browser.find_element(By.ID, "model-name").text, 20)
            model = browser.find_element(By.ID, "model-name").text
            box = browser.find_element(By.ID, "input")
            box.send_keys("In three short points: how does a paged KV cache work?")
            box.send_keys(Keys.ENTER)
            threads = background_load(server.base_url, model)
            time.sleep(4.0)
            browser.save_screenshot(str(out / "playground.png"))
            browser.find_element(By.ID, "engine").screenshot(str(out / "engine_view.png"))
            for t in threads:
                t.join()
        finally:
            browser.quit()
    print(f"wrote {out / 'playground.png'} and {out / 'engine_view.png'}")


if __name__ == "__main__":
    main()
