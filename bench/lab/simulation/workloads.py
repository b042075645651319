# SPDX-License-Identifier: Apache-2.0
"""The named workloads of ``ringkv bench load``: conversations whose turns re-send the whole history.

A conversation's first turn is the shared system prompt plus its own first message; each later turn appends what
the turn before generated and a new message (a user's message in ``chat``, a tool's output in ``agentic``), so
turn ``k``'s prompt is turn ``k - 1``'s prompt and output plus ``added``. Every length is drawn from its
``Lengths`` with one generator seeded by the run's seed; token ids are random (3..999), so two conversations
share exactly the system prompt. The distributions are written in bench/README.md ("Load at the seed's shape").
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Conversation:
    """One client's turns: turn ``k``'s prompt is turn ``k - 1``'s prompt and output plus ``turns[k]`` (its new
    token ids); turn ``k`` generates ``max_tokens[k]`` tokens. One turn: an independent prompt."""

    turns: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.turns) != len(self.max_tokens) or not self.turns:
            raise ValueError(f"{len(self.turns)} turns and {len(self.max_tokens)} max_tokens: give one per turn")

    @property
    def longest_request(self) -> int:
        """Tokens of the last turn's request, prompt and output."""
        return sum(map(len, self.turns)) + sum(self.max_tokens)


@dataclass(frozen=True)
class Part:
    """One component of a length distribution: with relative ``weight``, a length in ``low..high`` (both
    included), uniform, or log-uniform (``log``)."""

    weight: float
    low: int
    high: int
    log: bool = False

    def describe(self) -> str:
        return f"{self.low:,}-{self.high:,} {'log-uniform' if self.log else 'uniform'}"


@dataclass(frozen=True)
class Lengths:
    """A mixture of ``Part``s."""

    parts: tuple[Part, ...]

    def draw(self, rng: random.Random) -> int:
        part = (
            rng.choices(self.parts, weights=[p.weight for p in self.parts])[0] if len(self.parts) > 1 else self.parts[0]
        )
        if part.log:
            return min(part.high, int(math.exp(rng.uniform(math.log(part.low), math.log(part.high + 1)))))
        return rng.randint(part.low, part.high)

    def describe(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0].describe()
        total = sum(p.weight for p in self.parts)
        return " + ".join(f"{p.weight / total:.0%} {p.describe()}" for p in self.parts)


def uniform(low: int, high: int) -> Lengths:
    return Lengths((Part(1.0, low, high),))


@dataclass(frozen=True)
class Workload:
    """``conversations`` clients sharing a ``system_tokens`` system prompt, each of ``turns`` turns (uniform,
    both ends included); ``first``: the first turn's own message; ``added``: what each later turn appends after
    the previous output; ``output``: tokens each turn generates."""

    name: str
    conversations: int
    system_tokens: int
    turns: tuple[int, int]
    first: Lengths
    added: Lengths
    output: Lengths

    def describe(self) -> str:
        return (f"{self.name}: {self.conversations} conversations x {self.turns[0]}-{self.turns[1]} turns, shared "
                f"{self.system_tokens:,}-token system prompt; first message {self.first.describe()}; each later "
                f"turn adds {self.added.describe()} after the previous output; output {self.output.describe()} "
                f"tokens")  # fmt: skip


LONG_TOKENS, LONG_OUTPUT = 262_144, 512  # the long workload's request, prompt and output, and its output

WORKLOADS = {
    # a chat service: most turns add a short message (plus the previous reply), fewer tokens than W = 2048;
    # some paste a document
    "chat": Workload(
        name="chat", conversations=48, system_tokens=1536, turns=(4, 12),
        first=Lengths((Part(0.85, 16, 512), Part(0.15, 512, 4096))),
        added=Lengths((Part(0.85, 16, 512), Part(0.15, 512, 4096))),
        output=uniform(32, 512),
    ),
    # an agent: tool definitions in the system prompt, a task, then tool calls whose outputs are 1K-8K tokens
    "agentic": Workload(
        name="agentic", conversations=24, system_tokens=4096, turns=(3, 8),
        first=uniform(128, 1024),
        added=Lengths((Part(1.0, 1024, 8192, log=True),)),
        output=uniform(32, 256),
    ),
    # vLLM #55800's context: independent requests of 262,144 tokens each (prompt and output), no shared prefix
    "long": Workload(
        name="long", conversations=3, system_tokens=0, turns=(1, 1),
        first=uniform(LONG_TOKENS - LONG_OUTPUT, LONG_TOKENS - LONG_OUTPUT), added=uniform(0, 0),
        output=uniform(LONG_OUTPUT, LONG_OUTPUT),
    ),
}  # fmt: skip


def conversations(workload: Workload, seed: int) -> list[Conversation]:
    """The workload's conversations drawn from ``seed`` (the same list for the same seed, in every process)."""
    rng = random.Random(f"{seed}/{workload.name}")

    def tokens(n: int) -> tuple[int, ...]:
        # ids 3 and up: 1 is the fake model's sampled token, 2 the tail of the admission demo
        return tuple(rng.randrange(3, 1000) for _ in range(n))

    system = tokens(workload.system_tokens)
    drawn = []
    for _ in range(workload.conversations):
        count = rng.randint(*workload.turns)
        turns = [system + tokens(workload.first.draw(rng))]
        turns += [tokens(workload.added.draw(rng)) for _ in range(count - 1)]
        drawn.append(Conversation(tuple(turns), tuple(workload.output.draw(rng) for _ in range(count))))
    return drawn
