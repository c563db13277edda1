"""Offline engines that need no account and no network: each model ships inside a package.

They implement the provider seams (``ivr.stt.base``, ``ivr.tts.base``) or, for the LLM, run a
local OpenAI-compatible server that the ordinary LLM client talks to.
"""
