"""Messages -> prompt token ids through the tokenizer's chat template: content parts joined,
an assistant turn's ``reasoning_content`` handed on, tools rendered by the template where it
knows them (tool_formats.py) or written by tools.py, and the request's ``chat_template_kwargs``
(``enable_thinking``) passed as template variables — never over the arguments the server
sets itself."""

from __future__ import annotations

from typing import Any

from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.protocol import OpenAIError, bad_request
from tinyserve.entrypoints.tool_formats import template_text, tool_format

# apply_chat_template's own parameters: the server sets them; chat_template_kwargs may not.
TEMPLATE_OWN_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize",
    "chat_template", "continue_final_message", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "return_tensors",
})  # fmt: skip


def render_chat(
    tokenizer,
    messages: list,
    add_generation_prompt: bool = True,
    tools: list[T.Tool] | None = None,
    tool_choice: T.ToolChoice | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
) -> list[int]:
    """``continue_final``: the last message (an assistant's) is left open, no end of turn
    and no generation prompt after it, so that the answer continues it (a prefill)."""
    taken = sorted(set(template_kwargs or {}) & TEMPLATE_OWN_ARGS)
    if taken:
        raise bad_request(
            f"chat_template_kwargs: {taken[0]!r} is set by the server", "chat_template_kwargs"
        )
    conversation = []
    # OpenAI's developer role is its system role for a template that does not name it
    # (SmolLM2's rendered "<|im_start|>developer" and added its default system prompt too).
    developer = "developer" if "developer" in template_text(tokenizer) else "system"
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        turn = {"role": developer if m.role == "developer" else m.role, "content": content or ""}
        if getattr(m, "reasoning_content", None):  # an earlier answer's thinking
            turn["reasoning_content"] = m.reasoning_content
        conversation.append(turn)
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    fmt = tool_format(tokenizer) if tools else None
    if fmt is not None:  # the template renders the tools; calls in its format
        conversation = fmt.messages(conversation, messages)
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    else:
        conversation = T.render_messages(conversation, messages, tools or [], tool_choice,
                                         renders_tool_role(tokenizer))  # fmt: skip
    if continue_final:
        kwargs["continue_final_message"], add_generation_prompt = True, False
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
    except OpenAIError:
        raise
    except Exception as e:  # the template rejected the conversation (jinja raise_exception)
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


_TOOL_ROLE: dict[str, bool] = {}  # template text -> whether it writes a "tool" turn


def renders_tool_role(tokenizer) -> bool:
    """Whether the chat template writes a ``tool`` turn's content, tried once per template:
    ChatML writes any role; Phi-3's leaves out a role it does not know (the tool result never
    reached the model), Gemma 3's raises where roles do not alternate (a 400 on every tool
    round). Where it does not, tool results go in as user turns (tools.render_messages)."""
    text = template_text(tokenizer)
    if text not in _TOOL_ROLE:
        probe = "\u2063tool result\u2063"
        turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                 {"role": "tool", "content": probe}]  # fmt: skip
        try:
            out = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            _TOOL_ROLE[text] = probe in str(out)
        except Exception:  # noqa: BLE001 - the template refused it: no tool role
            _TOOL_ROLE[text] = False
    return _TOOL_ROLE[text]
