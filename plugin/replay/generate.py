"""Trace generators (``fdsched trace generate``). Imports nothing from FastDeploy.

Every generator is a pure function of ``(requests, seed)``: the same arguments give the same bytes.
Each writes the engine it was made for into the trace header, sized from the requests it drew:

``pressure``
    Long outputs on a KV pool about 1.5 times smaller than the peak demand (the most blocks the
    requests would hold at once on an unlimited pool, :func:`peak_demand_blocks`), with arrivals
    close together: the pool runs out while requests decode, and the scheduler must preempt.
``shared-prefix``
    Many requests over a few long system prompts (prefix groups) with short private suffixes and
    short outputs; the pool holds the system prompts and the running requests but not every
    finished suffix, so the prefix cache hits and also evicts.
``pd-prefill``
    A prefill node (``splitwise_role: prefill``): requests enter through the prefill-node path and
    leave after their first token. Most prompts start with one of a few shared prefixes, so the
    node's prefix-cache hit rate shows whether its blocks are recorded in the radix tree.
"""

from __future__ import annotations

import math
import random
from typing import Callable

from fdsched.core.common import ceil_div
from fdsched.replay.trace import ENGINE_DEFAULTS, dump_trace

__all__ = ["KINDS", "DEFAULT_REQUESTS", "generate", "generate_text", "peak_demand_blocks"]


def _blocks(tokens: int, block_size: int) -> int:
    return ceil_div(tokens, block_size)


def _min_pool(engine: dict) -> int:
    return _blocks(engine["max_model_len"], engine["block_size"]) + 2


def _effective_output(request: dict) -> int:
    if request["max_tokens"] is None:
        return request["output_len"]
    return min(request["output_len"], request["max_tokens"])


def peak_demand_blocks(requests: list, block_size: int, max_num_seqs: int) -> int:
    """The most KV blocks the requests would hold at once on an unlimited pool.

    A simple model of an engine without a KV limit: requests are admitted first come first served
    at their arrival step while fewer than ``max_num_seqs`` run; each running request holds
    ``ceil((prompt + generated) / block_size)`` blocks and generates one token per step until its
    real output is done.
    """
    pending = sorted(requests, key=lambda r: r["arrival"])
    running: list = []  # [prompt_len, generated, output]
    step = index = peak = 0
    while index < len(pending) or running:
        while index < len(pending) and pending[index]["arrival"] <= step and len(running) < max_num_seqs:
            request = pending[index]
            running.append([request["prompt_len"], 0, _effective_output(request)])
            index += 1
        for entry in running:
            entry[1] += 1
        peak = max(peak, sum(_blocks(p + g, block_size) for p, g, _ in running))
        running = [entry for entry in running if entry[1] < entry[2]]
        step += 1
    return peak


def _pressure(n: int, rng: random.Random) -> tuple:
    engine = {"block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 2048}
    requests = []
    arrival = 0
    for i in range(n):
        # Half the prompts are long: their prefill takes several chunks, so the pool can run out
        # while one of them is still prefilling (a prefill-phase victim under the pre-change choice).
        prompt_len = rng.randint(64, 512) if rng.random() >= 0.5 else rng.randint(768, 1280)
        output_len = rng.randint(256, 768)
        if rng.random() < 0.3:
            max_tokens = None  # the engine's default: the rest of the context
        else:
            max_tokens = min(engine["max_model_len"] - prompt_len, output_len + rng.randint(0, 512))
        requests.append(
            {"id": f"p{i:03d}", "arrival": arrival, "prompt_len": prompt_len, "max_tokens": max_tokens, "output_len": output_len}
        )
        arrival += rng.randint(0, 4)
    peak = peak_demand_blocks(requests, engine["block_size"], engine["max_num_seqs"])
    engine["num_gpu_blocks"] = max(math.ceil(peak / 1.5), _min_pool(engine))
    description = (
        f"{n} requests, half with long prompts (768-1280 tokens, prefilled in 256-token chunks), outputs of "
        f"256-768 tokens, arriving over steps 0..{requests[-1]['arrival']}; they would hold up to {peak} KV "
        f"blocks at once on an unlimited pool, this one has {engine['num_gpu_blocks']} (about 1.5x short): "
        f"requests run out of blocks and get preempted."
    )
    return engine, requests, description


def _shared_prefix(n: int, rng: random.Random) -> tuple:
    engine = {"block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}
    groups = [("sys-a", 512), ("sys-b", 384), ("sys-c", 320), ("sys-d", 256)]
    weights = [8, 4, 2, 1]
    requests = []
    arrival = 0
    unique_blocks = []
    for i in range(n):
        group, prefix_len = rng.choices(groups, weights)[0]
        suffix = rng.randint(16, 160)
        output_len = rng.randint(8, 96)
        max_tokens = None if rng.random() < 0.25 else output_len + rng.randint(0, 64)
        requests.append(
            {
                "id": f"s{i:03d}",
                "arrival": arrival,
                "prompt_len": prefix_len + suffix,
                "prefix_group": group,
                "prefix_len": prefix_len,
                "max_tokens": max_tokens,
                "output_len": output_len,
            }
        )
        unique_blocks.append(_blocks(suffix + output_len, engine["block_size"]) + 1)
        arrival += rng.randint(1, 6)
    prefix_blocks = sum(_blocks(length, engine["block_size"]) for _, length in groups)
    running = engine["max_num_seqs"] * math.ceil(sum(unique_blocks) / len(unique_blocks))
    engine["num_gpu_blocks"] = max(prefix_blocks + running, _min_pool(engine))
    description = (
        f"{n} requests over {len(groups)} system prompts ({', '.join(f'{g} {l} tokens' for g, l in groups)}), "
        f"short suffixes and outputs; a pool of {engine['num_gpu_blocks']} blocks holds the system prompts and "
        f"the running requests but not every finished suffix: prefix hits and evictions."
    )
    return engine, requests, description


def _pd_prefill(n: int, rng: random.Random) -> tuple:
    engine = {
        "block_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 1024,
        "max_model_len": 4096,
        "splitwise_role": "prefill",
    }
    groups = [("doc-a", 1024), ("doc-b", 768), ("doc-c", 512)]
    requests = []
    arrival = 0
    prompt_blocks = []
    for i in range(n):
        request = {"id": f"d{i:03d}", "arrival": arrival}
        if rng.random() < 0.8:
            group, prefix_len = rng.choice(groups)
            request.update(prompt_len=prefix_len + rng.randint(32, 512), prefix_group=group, prefix_len=prefix_len)
        else:
            request["prompt_len"] = rng.randint(256, 1536)
        output_len = rng.randint(64, 512)  # what the decode node would generate; this node stops at the first
        request["max_tokens"] = output_len + rng.randint(0, 256)
        request["output_len"] = output_len
        requests.append(request)
        prompt_blocks.append(_blocks(request["prompt_len"], engine["block_size"]) + 2)
        arrival += rng.randint(0, 2)
    engine["num_gpu_blocks"] = max(
        math.ceil(engine["max_num_seqs"] * sum(prompt_blocks) / len(prompt_blocks) * 0.75), _min_pool(engine)
    )
    description = (
        f"prefill node: {n} requests, 80% over {len(groups)} shared document prefixes; each leaves after its first "
        f"token. A pool of {engine['num_gpu_blocks']} blocks makes preallocation wait and the cache evict."
    )
    return engine, requests, description


KINDS: dict = {"pressure": _pressure, "shared-prefix": _shared_prefix, "pd-prefill": _pd_prefill}
DEFAULT_REQUESTS = {"pressure": 48, "shared-prefix": 96, "pd-prefill": 64}


def generate(kind: str, requests: int, seed: int) -> tuple:
    """(engine, request dicts, description, generator info) for one kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; allowed: {', '.join(KINDS)}")
    if not isinstance(requests, int) or requests < 1:
        raise ValueError(f"requests={requests!r}; allowed: an integer >= 1")
    make: Callable = KINDS[kind]
    engine, reqs, description = make(requests, random.Random(seed))
    engine = {k: engine[k] for k in ENGINE_DEFAULTS if k in engine}  # stable key order
    return engine, reqs, description, {"kind": kind, "requests": requests, "seed": seed}


def generate_text(kind: str, requests: int, seed: int) -> str:
    engine, reqs, description, generator = generate(kind, requests, seed)
    return dump_trace(reqs, engine=engine, description=description, generator=generator)
