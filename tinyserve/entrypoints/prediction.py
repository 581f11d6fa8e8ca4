"""OpenAI's Predicted Outputs on chat completions and completions: ``"prediction": {"type":
"content", "content": "..."}`` (a string or text parts) is tokenized and becomes the
request's draft source (spec_decode/prediction.py); the answer is what it would be without
it. Usage then reports ``completion_tokens_details.accepted_prediction_tokens`` /
``rejected_prediction_tokens`` (outputs.py ``kept_in_order``)."""

from __future__ import annotations

from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import bad_request

MAX_PREDICTION_TOKENS = 32_768


def prediction_ids(req, tokenizer) -> tuple[int, ...] | None:
    """The prediction's token ids (no special tokens), None without one: a 400 when it is
    empty, too long, or asked with ``n`` > 1 (OpenAI's limit: one answer to predict)."""
    if not getattr(req, "prediction", None):  # (completions: an undeclared field's value)
        return None
    pred: P.Prediction = req.prediction
    text = pred.content
    if isinstance(text, list):
        text = "".join(part.text for part in text)
    if not text:
        raise bad_request("prediction: content must not be empty", "prediction")
    if req.n != 1:
        raise bad_request("prediction: not supported with n > 1", "prediction")
    if len(text) > 8 * MAX_PREDICTION_TOKENS:  # before tokenizing it on the event loop
        raise bad_request(f"prediction: over {8 * MAX_PREDICTION_TOKENS} characters", "prediction")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > MAX_PREDICTION_TOKENS:
        raise bad_request(
            f"prediction: {len(ids)} tokens, more than {MAX_PREDICTION_TOKENS}", "prediction"
        )
    return tuple(int(t) for t in ids)
