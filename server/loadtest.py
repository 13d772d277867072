"""A bounded load test against a running hybrid-serve on this machine:

    python -m server.loadtest --url http://127.0.0.1:8000 --requests 64 --concurrency 8 --max-tokens 64 --duration 60

`concurrency` clients each send streaming `/v1/completions` requests (EOS ignored, so each generates exactly
`max-tokens` tokens) one after the other, until `requests` have been sent or `duration` seconds have passed; then it
prints throughput (requests/s, output tokens/s) and p50/p99 of latency and time to first token. Only loopback
URLs are accepted: this is a tool for one's own server, not for loading someone else's. Needs httpx (the `test`
extra).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

# A load test, not a flood: bounds on what one run may send.
LIMITS = {"requests": 100_000, "concurrency": 512, "max_tokens": 32_768, "prompt_words": 100_000}
MAX_DURATION_S = 3600
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "the", "server", "streams",
         "tokens", "back")


@dataclass(frozen=True)
class Sample:
    latency: float
    ttft: float
    num_tokens: int


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


async def one_request(client, url: str, body: dict) -> Sample:
    start = time.perf_counter()
    ttft, num_tokens = None, 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    return Sample(latency, ttft if ttft is not None else latency, num_tokens)


async def run(args) -> dict:
    import httpx

    url = args.url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    samples: list[Sample] = []
    errors: list[str] = []
    num_sent = 0
    deadline = time.perf_counter() + args.duration

    async def client_loop(client, worker: int):
        nonlocal num_sent
        while num_sent < args.requests and time.perf_counter() < deadline:
            index = num_sent
            num_sent += 1
            prompt = " ".join(WORDS[(index + k) % len(WORDS)] for k in range(args.prompt_words))
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
                    "temperature": 0, "stream_options": {"include_usage": True}}
            if args.model:
                body["model"] = args.model
            try:
                samples.append(await one_request(client, url, body))
            except Exception as exc:  # reported, not fatal: the test measures what the server does
                errors.append(f"{type(exc).__name__}: {exc}")

    start = time.perf_counter()
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(args.duration + 60)) as client:
        await asyncio.gather(*(client_loop(client, w) for w in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    return summarize(samples, errors, elapsed)


def summarize(samples: list[Sample], errors: list[str], elapsed: float) -> dict:
    num_tokens = sum(s.num_tokens for s in samples)
    return {"num_ok": len(samples), "num_failed": len(errors), "seconds": elapsed,
            "requests_per_s": len(samples) / elapsed, "output_tokens_per_s": num_tokens / elapsed,
            "latency_p50_s": percentile([s.latency for s in samples], 50),
            "latency_p99_s": percentile([s.latency for s in samples], 99),
            "ttft_p50_s": percentile([s.ttft for s in samples], 50),
            "ttft_p99_s": percentile([s.ttft for s in samples], 99),
            "first_error": errors[0] if errors else None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m server.loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    parser.add_argument("--requests", type=int, default=64, help="requests to send in all")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--duration", type=float, default=60.0, help="stop sending after this many seconds")
    parser.add_argument("--prompt-words", type=int, default=32, help="words per prompt")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not is_loopback(args.url):
        print(f"loadtest: error: {args.url} is not a loopback address; this tool only loads a server on this "
              f"machine (127.0.0.1, ::1, localhost)", file=sys.stderr)
        return 1
    for name, most in LIMITS.items():
        if not 1 <= getattr(args, name) <= most:
            print(f"loadtest: error: --{name.replace('_', '-')} must be in [1, {most}]", file=sys.stderr)
            return 1
    if not 0 < args.duration <= MAX_DURATION_S:
        print(f"loadtest: error: --duration must be in (0, {MAX_DURATION_S}] seconds", file=sys.stderr)
        return 1
    report = asyncio.run(run(args))
    print(f"{report['num_ok']} requests ok, {report['num_failed']} failed in {report['seconds']:.1f} s "
          f"(concurrency {args.concurrency}, {args.max_tokens} tokens each)")
    print(f"throughput: {report['requests_per_s']:.2f} requests/s, {report['output_tokens_per_s']:.1f} output "
          f"tokens/s")
    print(f"latency: p50 {report['latency_p50_s']:.3f} s, p99 {report['latency_p99_s']:.3f} s; time to first "
          f"token: p50 {report['ttft_p50_s']:.3f} s, p99 {report['ttft_p99_s']:.3f} s")
    if report["first_error"]:
        print(f"first error: {report['first_error']}")
    return 0 if report["num_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
