"""Generates `tiny_instructions.jsonl`: 200 short instruction/response pairs for the offline `--tiny` workload.

Deterministic (fixed seed, fixed word lists), so re-running it reproduces the committed file
byte for byte: `python workloads/data/make_tiny_instructions.py`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
ANIMALS = ["cat", "dog", "horse", "bird", "fish", "mouse", "tiger", "rabbit"]
CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Peru": "Lima",
    "Kenya": "Nairobi",
}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

Pair = dict[str, str]


def add(rng: random.Random) -> Pair:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return {"instruction": f"Add {a} and {b} .", "response": f"The sum is {a + b} ."}


def reverse(rng: random.Random) -> Pair:
    words = rng.sample(COLORS, 3)
    return {"instruction": "Reverse the words : " + " ".join(words), "response": " ".join(reversed(words))}


def capital(rng: random.Random) -> Pair:
    country = rng.choice(sorted(CAPITALS))
    return {
        "instruction": f"What is the capital of {country} ?",
        "response": f"The capital of {country} is {CAPITALS[country]} .",
    }


def spell(rng: random.Random) -> Pair:
    word = rng.choice(ANIMALS)
    return {"instruction": f"Spell the word {word} .", "response": " ".join(word)}


def count(rng: random.Random) -> Pair:
    n = rng.randint(1, 6)
    words = [rng.choice(ANIMALS) for _ in range(n)]
    return {"instruction": "How many words : " + " ".join(words), "response": f"There are {NUMBER_WORDS[n]} words ."}


def describe(rng: random.Random) -> Pair:
    color, animal = rng.choice(COLORS), rng.choice(ANIMALS)
    return {
        "instruction": f"Describe a {color} {animal} .",
        "response": f"It is a {animal} and it is {color} .",
    }


TASKS: list[Callable[[random.Random], Pair]] = [add, reverse, capital, spell, count, describe]


def generate(n: int = 200, seed: int = 0) -> list[Pair]:
    rng = random.Random(seed)
    return [TASKS[i % len(TASKS)](rng) for i in range(n)]


def main() -> None:
    out = Path(__file__).with_name("tiny_instructions.jsonl")
    out.write_text("".join(json.dumps(pair) + "\n" for pair in generate()))


if __name__ == "__main__":
    main()
