"""The OpenAI Agents SDK against the real server: an agent with a function tool and an output
type sends ``tools`` and ``response_format`` (or, over /v1/responses, ``text.format``)
together in every turn: a 400 before. Now its loop runs: the model calls the tool, the SDK
sends the result back, and the run ends in a parsed output object."""

from __future__ import annotations

import asyncio

import agents
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from tests.support.api import MODEL


class Weather(BaseModel):
    city: str = Field(max_length=30)
    sunny: bool


@pytest.mark.parametrize("model_cls", [agents.OpenAIChatCompletionsModel,
                                       agents.OpenAIResponsesModel])  # fmt: skip
def test_agent_with_tools_and_an_output_type_runs(server, model_cls):
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def run(seed: int):
        client = AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="forecaster", instructions="Answer about the weather.", tools=[get_weather],
            output_type=Weather, model=model_cls(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(temperature=1.0, max_tokens=100,
                                                extra_body={"seed": seed}),
        )  # fmt: skip
        try:
            return (
                await agents.Runner.run(agent, "Is it sunny in Paris?", max_turns=3)
            ).final_output
        except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):  # a small model may keep
            return None  # calling the tool, or run into max_tokens
        finally:
            await client.close()

    outputs = [asyncio.run(run(seed)) for seed in range(6)]
    assert any(isinstance(o, Weather) for o in outputs), outputs
    assert calls  # some run called the tool and sent its result back
