"""Request fields that no request model declares (pydantic keeps them as ``model_extra``):
what the OpenAI SDK and vLLM's API may send beside the fields each API honours. None is
silently dropped when it would change the output:

- IGNORED: accepted and not used, as OpenAI itself treats them — metadata, billing, routing
  and caching hints that leave the output as it is.
- REJECTED: fields that would change the output (or the prompt) and that nothing here
  serves: a 400 naming the field, unless the value asks for nothing (null, false, an empty
  list or object, or the one harmless value in HARMLESS).
- anything else: unknown to us; logged as a warning (one line a request, the names cut and
  escaped) and ignored (vLLM's behaviour; OpenAI answers 400, which breaks client libraries
  that send their own extras).

vLLM's older ``guided_*`` keys are not extras: protocol.py maps them onto
``structured_outputs`` before validation.
"""

from __future__ import annotations

import logging
from typing import Any

from tinyserve.entrypoints.protocol import bad_request

logger = logging.getLogger(__name__)

IGNORED = frozenset({
    "user", "metadata", "store", "safety_identifier", "service_tier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "priority", "request_id",
    "guided_decoding_backend",  # which grammar library: ours is llguidance
    # /v1/responses, documented in the README: prompts over the context window are a 400
    # whatever truncation says; include asks for extra output data none of which is made.
    "truncation", "include",
})  # fmt: skip

REJECTED = {
    # OpenAI
    "audio": "audio output is not supported: text only",
    "modalities": 'only ["text"] is supported',
    "reasoning_effort": "the served model has no reasoning mode",
    "reasoning": "the served model has no reasoning mode",
    "verbosity": "not supported by the served model",
    "web_search_options": "web search is not available",
    "functions": "the deprecated functions field is not supported: use tools",
    "function_call": "the deprecated function_call field is not supported: use tool_choice",
    "moderation": "moderation is not available",
    "best_of": "best_of other than n is not supported",
    "conversation": "conversations are not stored: the server is stateless",
    "prompt": "reusable prompt templates are not supported: send input",
    "max_tool_calls": "not supported",
    "context_management": "not supported",
    "background_options": "background responses are not supported",
    "image": "image input is not supported",
    "access_programs": "not supported",
    "top_logprobs": "not taken here (/v1/responses returns no logprobs; on /v1/completions "
    "send logprobs: k)",
    # vLLM's extensions that change the output or the prompt
    "allowed_token_ids": "not supported: use logit_bias or structured_outputs",
    "bad_words": "not supported: use logit_bias",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "logits_processors": "custom logits processors are not supported",
    "chat_template": "a per-request chat template is not accepted: the model's own is used",
    # Declared by /v1/chat/completions (both) and /v1/completions (prediction): elsewhere a 400.
    "chat_template_kwargs": "only /v1/chat/completions takes chat_template_kwargs",
    "prediction": "only /v1/chat/completions and /v1/completions take a prediction",
    "continue_final_message": "not supported",
    "echo": "echo is a completions field",
    "documents": "not supported",
    "truncate_prompt_tokens": "not supported: prompts over the context window are a 400",
    "return_tokens_as_token_ids": "not supported",
    "cache_salt": "only /v1/chat/completions and /v1/completions take a cache_salt",
    "mm_processor_kwargs": "multimodal input is not supported",
}

# A value that asks for what the server does anyway.
HARMLESS: dict[str, Any] = {"modalities": ["text"], "use_beam_search": False, "echo": False}


def check_extra_fields(req: Any) -> None:
    """A 400 for the first rejected field ``req`` carries with a value; log the rest."""
    extra = req.model_extra or {}
    unknown = []
    for name, value in extra.items():
        if name in REJECTED and not _asks_nothing(name, value, req):
            raise bad_request(f"{name}: {REJECTED[name]}", name)
        if name not in IGNORED and name not in REJECTED:
            unknown.append(name)
    if unknown:  # one line a request; names shortened and escaped (they are the client's)
        names = ", ".join(repr(n[:40]) for n in unknown[:LOGGED_NAMES])
        more = f" and {len(unknown) - LOGGED_NAMES} more" if len(unknown) > LOGGED_NAMES else ""
        logger.warning("ignored unknown request fields: %s%s", names, more)


LOGGED_NAMES = 8


def _asks_nothing(name: str, value: Any, req: Any) -> bool:
    if value is None or value is False or value == [] or value == {}:
        return True
    if name == "best_of":
        return value == getattr(req, "n", 1)
    return name in HARMLESS and value == HARMLESS[name]
