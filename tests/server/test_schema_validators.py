"""Both validators the server tests use reject what OpenAI's clients would reject."""

from __future__ import annotations

import pytest
from server_harness import COMPLETION_CHUNK, OPENAI_SPEC, OpenAISchemas, OpenAITypedModels

GOOD = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}]}


def validators():
    found = [OpenAITypedModels()]
    if OPENAI_SPEC.is_file():
        import yaml

        with open(OPENAI_SPEC, encoding="utf-8") as f:
            found.append(OpenAISchemas(yaml.safe_load(f)))
    return found


@pytest.mark.parametrize("validator", validators(), ids=lambda v: v.source)
def test_validators_accept_good_and_reject_bad_bodies(validator):
    validator.validate("CreateCompletionResponse", GOOD)
    chunk = {**GOOD, "choices": [{**GOOD["choices"][0], "finish_reason": None}]}
    validator.validate(COMPLETION_CHUNK, chunk)
    with pytest.raises(Exception, match="finish_reason|literal|null|None"):
        validator.validate("CreateCompletionResponse", chunk)  # only stream chunks may say null
    with pytest.raises(Exception, match="created|integer|int"):
        validator.validate("CreateCompletionResponse", {**GOOD, "created": "yesterday"})
    with pytest.raises(Exception, match="error|required|missing"):
        validator.validate("ErrorResponse", {"message": "no envelope"})
