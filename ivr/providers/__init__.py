"""What every provider kind shares. The kinds themselves live one room above, each with its
seam, its resilience wrapper and every implementation: ``ivr.stt``, ``ivr.tts``, ``ivr.llm``.

- ``openai_http``: OpenAI-compatible HTTP over aiohttp (the endpoint, the SSE reader, the
  ``WaitClock`` limits) and every way a provider call can fail mapped to a ``ProviderError``.
- ``resilience``: retries and fallbacks within one budget (``first_output``), and the turn
  deadline a call sets for the stages of a reply.
- ``streaming``: what the streaming seams share (audio formats, words with times).
"""
