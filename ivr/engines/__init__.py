"""Offline machinery that is not a provider itself: the llama.cpp server process the offline LLM
(``ivr.llm.llama_local``) talks to, and the Smart Turn end-of-turn model. Every model ships
inside a package; nothing is downloaded at run time.
"""
