"""Speed of the packaged offline LLM (SmolLM2-135M via llama-cpp-py-sync) over its HTTP API.

    .venv/bin/python bench/local_llm.py [--runs 3] [--max-tokens 64]

Prints server start time, then per IVR prompt: time to first token, decode tokens/s
(streamed chunks after the first / time after the first), and the reply; then the
server's peak RSS. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from openai import AsyncOpenAI

from ivr.engines.llm_server import LocalLlmServer

SYSTEM = "You are a phone assistant for Acme Bank. Answer in one short sentence."
PROMPTS = (
    "I want to check my balance",
    "What are your opening hours?",
    "I lost my card, what should I do?",
)


async def one(
    client: AsyncOpenAI, model: str, prompt: str, max_tokens: int
) -> tuple[float, float, str]:
    start = time.perf_counter()
    first = 0.0
    pieces: list[str] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        stream=True,
        temperature=0.3,
        max_tokens=max_tokens,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces:
                first = time.perf_counter() - start
            pieces.append(chunk.choices[0].delta.content)
    rest = time.perf_counter() - start - first
    return first, (len(pieces) - 1) / rest if rest > 0 else 0.0, "".join(pieces)


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def main(runs: int, max_tokens: int) -> None:
    start = time.perf_counter()
    async with LocalLlmServer() as server:
        print(f"server ready in {time.perf_counter() - start:.2f} s at {server.base_url}")
        client = AsyncOpenAI(base_url=server.base_url, api_key=server.api_key)
        for prompt in PROMPTS:
            results = [await one(client, server.model, prompt, max_tokens) for _ in range(runs)]
            ttft = statistics.median(r[0] for r in results) * 1000
            tps = statistics.median(r[1] for r in results)
            print(f"{prompt!r}: ttft {ttft:.0f} ms, {tps:.1f} tok/s -> {results[-1][2]!r}")
        assert server.pid is not None
        print(f"server peak RSS {peak_rss_mb(server.pid):.0f} MB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.max_tokens))
