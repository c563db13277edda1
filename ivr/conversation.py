"""What a call does once its stream is up. Until the flow engine is wired in, a plain LLM agent."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ivr.call.io import CallIO, HungUp, ListenSpec, NoInput, Utterance
from ivr.gateway import Gateway
from ivr.llm.base import ChatMessage, TextDelta
from ivr.state.base import CallRecord

SYSTEM_PROMPT = (
    "You are a friendly phone assistant. Answer in one or two short spoken sentences. "
    "No lists, no markdown."
)
GREETING = "Hello! How can I help you today?"


def attach_flows(gateway: Gateway) -> None:
    async def conversation(io: CallIO, record: CallRecord) -> None:
        history = [ChatMessage("system", SYSTEM_PROMPT)]
        spoken = await io.say(GREETING)
        history.append(ChatMessage("assistant", spoken.text_heard))
        silences = 0
        while True:
            heard = await io.listen(ListenSpec(no_input_timeout=8.0))
            if isinstance(heard, HungUp):
                return
            if isinstance(heard, NoInput):
                silences += 1
                if silences >= 2:
                    await io.say("Goodbye!", interruptible=False)
                    await io.hangup()
                    return
                await io.say("Are you still there?")
                continue
            if not isinstance(heard, Utterance) or not heard.text:
                await io.say("Sorry, I didn't catch that.")
                continue
            silences = 0
            history.append(ChatMessage("user", heard.text))

            async def text() -> AsyncIterator[str]:
                async for event in gateway.llm.stream_chat(history):
                    if isinstance(event, TextDelta):
                        yield event.text

            spoken = await io.say_stream(text())
            history.append(ChatMessage("assistant", spoken.text_heard))

    gateway.conversation = conversation
    gateway.static_prompts = lambda: {GREETING}
