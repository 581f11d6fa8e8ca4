"""/tokenize and /detokenize (vLLM's): text or chat messages to token ids through the same
tokenizer and chat template as generation, and back. A chat's ``tools``, ``tool_choice`` and
``chat_template_kwargs`` render as a chat completion renders them (its ``prompt_tokens``);
``return_token_strs`` adds each id's token string. Fields vLLM takes that these do not
(``continue_final_message``, ``chat_template``, ...) are 400s, as on chat (request_fields.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt

from tinyserve.entrypoints.protocol import ChatMessage, _Request, bad_request
from tinyserve.entrypoints.request_fields import check_extra_fields
from tinyserve.entrypoints.serving import OpenAIServing
from tinyserve.entrypoints.tools import Tool, ToolChoice


class TokenizeRequest(_Request):
    """Either ``prompt`` (text) or ``messages`` (a chat, through the chat template)."""

    model_config = ConfigDict(extra="allow")  # kept for check_extra_fields
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # renders the prompt too (chat's system message)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[StrictInt]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeServing(OpenAIServing):
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        check_extra_fields(req)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        if req.messages is None and (req.tools or req.tool_choice or req.chat_template_kwargs):
            name = next(n for n in ("tools", "tool_choice", "chat_template_kwargs")
                        if getattr(req, n))  # fmt: skip
            raise bad_request(f"{name}: only with messages", name)
        if req.messages is not None:
            tools = self.checked_tools(req.tools, req.tool_choice) or None
            ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, tools,
                                       req.tool_choice, req.chat_template_kwargs)  # fmt: skip
        else:
            ids = self.encode(req.prompt or "", req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.info.max_model_len,
                                tokens=ids, token_strs=strs)  # fmt: skip

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.engine.info.vocab_size
        for t in req.tokens:
            if not 0 <= t < vocab:
                raise bad_request(f"tokens: token id {t} is outside [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
