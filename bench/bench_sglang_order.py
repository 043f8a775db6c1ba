"""MORI's eviction order against SGLang's LRU, on SGLang's own radix cache: how much of
each agent's prompt is still cached when it comes back.

Runs inside SGLang's venv (``scripts/sglang_cpu_env.sh``; SGLang 0.5.23's
``UnifiedRadixCache`` on CPU pools, ``mori.sglang_plugin.cpu_rig``; no server, no
model). A closed loop of agent programs: each alternates busy phases (LLM calls one
round apart, its context growing by one call's tokens) with tool calls (idle for some
rounds), and is replaced by a new program when it ends. Every round, each busy program's
request is matched against the tree, what is missing is computed (evicting to make
room, as SGLang's scheduler does), and it is checkpointed into the tree. The same
schedule (one seed) runs twice: on SGLang's default cache with LRU eviction, and on the
``mori`` backend with the labels a MORI gateway sends (busy while in a busy phase, idle
during a tool call, inactive once ended). The figure is the share of prompt tokens found
cached on the device; recomputed tokens are the rest. A pool that holds all contexts
makes the two equal; the gap opens as it shrinks.

    PYTHONPATH=src ~/.cache/mori/sglang-venv/bin/python bench/bench_sglang_order.py \\
        [--programs 8] [--pool-ratio 0.5,0.35,0.25] [--rounds 400]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("SGLANG_PLUGINS", "none")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mori.plugin_channel.protocol import Message  # noqa: E402
from mori.sglang_plugin.cpu_rig import PAGE, Tree, build_tree  # noqa: E402


@dataclass
class Agent:
    name: str
    tokens: list[int]
    busy_left: int  # calls left in this busy phase
    tool_left: int  # rounds left in this tool call
    calls_left: int


class Workload:
    """A seeded schedule of agents (module doc); ``step()`` gives one round's requests
    and the labels that changed."""

    def __init__(self, programs: int, seed: int, first: int, growth: int, calls: int,
                 busy: int, tool: int) -> None:
        self.rng = random.Random(seed)
        self.first, self.growth, self.calls, self.busy, self.tool = (first, growth, calls,
                                                                    busy, tool)
        self.serial = 0
        self.agents = [self._new() for _ in range(programs)]

    def _new(self) -> Agent:
        self.serial += 1
        base = self.serial * 1_000_000
        return Agent(f"agent-{self.serial}", list(range(base, base + self.first)),
                     self.rng.randint(1, self.busy), 0, self.rng.randint(self.calls // 2,
                                                                        self.calls))

    def step(self) -> tuple[list[tuple[str, list[int]]], dict[str, str]]:
        requests: list[tuple[str, list[int]]] = []
        labels: dict[str, str] = {}
        for i, a in enumerate(self.agents):
            if a.tool_left > 0:
                a.tool_left -= 1
                if a.tool_left == 0:
                    labels[a.name] = "busy"
                continue
            requests.append((a.name, list(a.tokens)))
            start = a.tokens[-1] + 1
            a.tokens += range(start, start + self.growth)
            a.calls_left -= 1
            a.busy_left -= 1
            if a.calls_left <= 0:
                labels[a.name] = "inactive"
                self.agents[i] = self._new()
                labels[self.agents[i].name] = "busy"
            elif a.busy_left <= 0:
                a.busy_left = self.rng.randint(1, self.busy)
                a.tool_left = self.rng.randint(1, self.tool)
                labels[a.name] = "idle"
        return requests, labels


def run(tree: Tree, work: Workload, rounds: int, labelled: bool) -> float:
    if labelled:
        tree.cache.mori_apply([Message("set", labels={a.name: "busy" for a in work.agents})])
    for _ in range(rounds):
        requests, labels = work.step()
        if labelled and labels:
            tree.cache.mori_apply([Message("set", labels=labels)])
        for name, tokens in requests:
            tree.run(name, tokens)
    return tree.hits / tree.prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=8, help="concurrent agents")
    parser.add_argument("--pool-ratio", default="0.5,0.35,0.25",
                        help="device pool as shares of the agents' peak contexts summed")
    parser.add_argument("--rounds", type=int, default=400, help="rounds of the loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=64, help="first prompt, tokens")
    parser.add_argument("--growth", type=int, default=8, help="tokens a call adds")
    parser.add_argument("--calls", type=int, default=40, help="most calls a program makes")
    parser.add_argument("--busy", type=int, default=6, help="most calls in a busy phase")
    parser.add_argument("--tool", type=int, default=12, help="most rounds of a tool call")
    args = parser.parse_args(argv)
    peak = args.programs * (args.first + args.calls * args.growth)
    print(f"{args.programs} agents, contexts {args.first} + {args.growth} tokens a call, up "
          f"to {args.calls} calls; {args.rounds} rounds; page {PAGE} tokens")
    print(f"{'pool (tokens)':>14} {'share of peak':>13} {'LRU cached':>11} "
          f"{'MORI cached':>12} {'recomputed MORI / LRU':>22}")
    for ratio in (float(r) for r in args.pool_ratio.split(",")):
        pool = max(PAGE * 4, int(peak * ratio) // PAGE * PAGE)
        shares = []
        for backend_name, labelled in ((None, False), ("mori", True)):
            work = Workload(args.programs, args.seed, args.first, args.growth, args.calls,
                            args.busy, args.tool)
            tree = build_tree(backend_name, device_tokens=pool)
            try:
                shares.append(run(tree, work, args.rounds, labelled))
            finally:
                if backend_name == "mori":
                    tree.cache.mori_close()
        lru, mori = shares
        print(f"{pool:>14,} {ratio:>13.2f} {100 * lru:>10.1f}% {100 * mori:>11.1f}% "
              f"{(1 - mori) / (1 - lru) if lru < 1 else 1.0:>22.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
