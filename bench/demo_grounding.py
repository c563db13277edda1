"""How well, and how fast, an offline GGUF model answers the demo call's questions.

    .venv/bin/python bench/demo_grounding.py                    # the packaged SmolLM2-135M
    .venv/bin/python bench/demo_grounding.py --model a.gguf --model b.gguf --threads 2

The questions go in exactly as the demo's agent asks them (flows/demo.yaml, node
``questions``: its system prompt, the knowledge file, its greeting, then the caller), greedy,
in process (llama.cpp through ``ivr.engines.llama``, no HTTP). Per model: file size, licence
and chat template from the GGUF, then per question the answer, whether it carries the fact from
flows/knowledge/harbor_bikes.md, time to first token with a cold cache (another prompt ran
before) and with the agent's prompt already cached (what the demo's warm-up and a second turn
get), and decode tokens/s. Timings are wall time: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ivr.engines.llama import ChatTurn, EngineError, GenerationStats, LlamaEngine, SamplingParams
from ivr.engines.llm_server import model_path
from ivr.flows.loader import load_flow
from ivr.flows.nodes import AgentNode

FLOW = Path("flows/demo.yaml")
AGENT = "questions"
KNOWLEDGE_HEADING = "\n\n# Reference information\n\n"  # as ivr.flows.agent builds the prompt
# Each question with a pattern the answer must match to carry the fact from the knowledge file.
QUESTIONS = (
    ("What are your opening hours?", r"\b(8|eight)\b.*\b(6|six)\b"),
    ("Are you open on Sunday?", r"\bclosed\b|\bnot open\b"),
    ("How much is a tune-up?", r"\b60\b|\bsixty\b"),
    ("Where can I find the shop?", r"42 Harbor Street"),
    ("How much does it cost to rent a bike?", r"\b25 dollars|\$25\b|twenty-five dollars"),
)
EVICT = [ChatTurn("user", "Name three colours.")]


@dataclass
class Answer:
    text: str
    first_token_s: float
    tokens_per_s: float


def ask(engine: LlamaEngine, turns: list[ChatTurn], max_tokens: int) -> Answer:
    stats = GenerationStats()
    start = time.perf_counter()
    first = 0.0
    pieces: list[str] = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for piece in engine.stream_chat(turns, params, threading.Event(), stats):
        if not pieces:
            first = time.perf_counter() - start
        pieces.append(piece)
    rest = time.perf_counter() - start - first
    rate = (stats.completion_tokens - 1) / rest if rest > 0 and stats.completion_tokens > 1 else 0
    return Answer("".join(pieces).strip(), first, rate)


def bench_model(path: Path, threads: int, max_tokens: int) -> None:
    node = load_flow(FLOW).nodes[AGENT]
    assert isinstance(node, AgentNode)
    system = node.system + KNOWLEDGE_HEADING + node.knowledge_text
    head = [ChatTurn("system", system), ChatTurn("assistant", node.greeting or "")]
    print(f"\n== {path.name}: {path.stat().st_size / 1e6:.0f} MB")
    try:
        engine = LlamaEngine(path, n_threads=threads)
    except EngineError as exc:
        print(f"   not usable: {exc}")
        return
    try:
        name, licence = engine.metadata("general.name"), engine.metadata("general.license")
        print(f"   name {name}, licence {licence}")
        ask(engine, EVICT, 2)  # the first decode allocates buffers: keep it out of the numbers
        right, colds, warms, rates = 0, [], [], []
        previous = QUESTIONS[-1][0]
        for question, fact in QUESTIONS:
            ask(engine, EVICT, 2)
            cold = ask(engine, [*head, ChatTurn("user", question)], max_tokens)
            ask(engine, [*head, ChatTurn("user", previous)], 2)
            warm = ask(engine, [*head, ChatTurn("user", question)], max_tokens)
            previous = question
            ok = re.search(fact, warm.text, re.IGNORECASE | re.DOTALL) is not None
            right += ok
            colds.append(cold.first_token_s)
            warms.append(warm.first_token_s)
            rates.append(warm.tokens_per_s)
            print(
                f"   {'ok ' if ok else 'BAD'} first token {cold.first_token_s * 1000:5.0f} ms "
                f"cold / {warm.first_token_s * 1000:4.0f} ms cached, "
                f"{warm.tokens_per_s:3.0f} tok/s  {question!r} -> {warm.text!r}"
            )
        print(
            f"   {right}/{len(QUESTIONS)} grounded; first token median "
            f"{statistics.median(colds) * 1000:.0f} ms cold, "
            f"{statistics.median(warms) * 1000:.0f} ms cached; "
            f"{statistics.median(rates):.0f} tok/s"
        )
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", action="append", type=Path, help="GGUF file (repeatable)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    models = args.model or [model_path()]
    if None in models:
        raise SystemExit("the packaged model is not installed: run scripts/setup")
    for path in models:
        bench_model(path, args.threads, args.max_tokens)


if __name__ == "__main__":
    main()
