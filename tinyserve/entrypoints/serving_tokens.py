"""/tokenize and /detokenize (vLLM's): text or chat messages to token ids through the same
tokenizer and chat template as generation, and back."""

from __future__ import annotations

from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import bad_request
from tinyserve.entrypoints.serving import OpenAIServing


class TokenizeServing(OpenAIServing):
    def tokenize(self, req: P.TokenizeRequest) -> P.TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt)
        else:
            ids = self.encode(req.prompt or "", req.add_special_tokens)
        return P.TokenizeResponse(
            count=len(ids), max_model_len=self.engine.info.max_model_len, tokens=ids
        )

    def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.engine.info.vocab_size
        for t in req.tokens:
            if not 0 <= t < vocab:
                raise bad_request(f"tokens: token id {t} is outside [0, {vocab})", "tokens")
        return P.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
