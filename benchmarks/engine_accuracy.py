"""What a fast mode costs in quality: fp32 vs bf16 vs int8 vs int4 on generated multiple-choice cloze items.

    python -m benchmarks.engine_accuracy [--modes float32 bfloat16 int8 int4] [--out results.json]

The items are built here, deterministically (no download): continue a sequence (days, months,
number words, letters, arithmetic progressions), a country's capital, an adjective's opposite, a
noun's plural; each has 4 choices. Every choice is scored through the engine's own scoring path
(echo + logprobs: the sum of the logprobs of its tokens after the context) and the item counts as
right when the answer scores highest. Per mode: accuracy, agreement with fp32's picks, and the mean
absolute difference of the choices' logprobs from fp32's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.results_file import write_results  # noqa: E402
from engines.builtin.config import EngineConfig  # noqa: E402
from engines.builtin.core import EngineCore  # noqa: E402

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
            "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "China": "Beijing",
            "England": "London", "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Finland": "Helsinki",
            "Denmark": "Copenhagen", "Hungary": "Budapest", "Thailand": "Bangkok", "Argentina": "Buenos Aires"}
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark", "old": "young",
             "rich": "poor", "strong": "weak", "hard": "soft", "early": "late", "tall": "short", "wet": "dry",
             "full": "empty", "loud": "quiet", "open": "closed", "clean": "dirty", "thick": "thin", "cheap": "expensive"}
PLURALS = {"cat": "cats", "dog": "dogs", "child": "children", "mouse": "mice", "box": "boxes", "man": "men",
           "woman": "women", "tooth": "teeth", "foot": "feet", "baby": "babies", "city": "cities", "bus": "buses",
           "leaf": "leaves", "knife": "knives", "person": "people", "goose": "geese"}


def choices_for(answer: str, pool: list[str], rng: random.Random) -> list[str]:
    others = rng.sample([x for x in pool if x != answer], 3)
    return [answer, *others]  # the answer first; scoring does not see the order


def sequence_items(words: list[str], rng: random.Random, cyclic: bool) -> list[tuple[str, list[str]]]:
    items = []
    span = len(words) if cyclic else len(words) - 3
    for start in range(span):
        shown = [words[(start + i) % len(words)] for i in range(3)]
        answer = words[(start + 3) % len(words)]
        items.append((", ".join(shown) + ",", [" " + c for c in choices_for(answer, words, rng)]))
    return items


def build_items(seed: int = 0) -> list[tuple[str, list[str]]]:
    """(context, choices with the right one first), about 300 of them."""
    rng = random.Random(seed)
    items = []
    for _ in range(3):  # three draws of distractors for the short lists
        items += sequence_items(DAYS, rng, cyclic=True)
        items += sequence_items(MONTHS, rng, cyclic=True)
    items += sequence_items(NUMBERS, rng, cyclic=False)
    items += sequence_items(LETTERS, rng, cyclic=False)
    for step in (1, 2, 3, 4, 5, 6, 10):
        for start in range(1, 13):
            seq = [start + step * i for i in range(5)]
            answer = seq[4]
            wrong = rng.sample([answer + d for d in (-2 * step, -step, 1, step, 2 * step, -1) if answer + d > 0], 3)
            items.append((", ".join(map(str, seq[:4])) + ",", [f" {answer}"] + [f" {w}" for w in wrong]))
    capitals = list(CAPITALS.values())
    for country, capital in CAPITALS.items():
        for template in ("The capital of {} is", "{}'s capital city is"):
            items.append((template.format(country), [" " + c for c in choices_for(capital, capitals, rng)]))
    for word, opposite in OPPOSITES.items():  # both directions
        items.append((f"The opposite of {word} is", [" " + c for c in choices_for(opposite, list(OPPOSITES.values()), rng)]))
        items.append((f"The opposite of {opposite} is", [" " + c for c in choices_for(word, list(OPPOSITES), rng)]))
    plurals = list(PLURALS.values())
    for singular, plural in PLURALS.items():
        items.append((f"One {singular}, two", [" " + c for c in choices_for(plural, plurals, rng)]))
    return items


async def choice_logprobs(engine: EngineCore, tokenizer, items) -> list[list[float]]:
    """For every item, each choice's summed logprob after the context."""

    async def one(context: str, choice: str) -> float:
        prefix = tokenizer.encode(context)
        tokens = tokenizer.encode(context + choice)
        scores = await engine.score(tokens)  # scores[i] is token i + 1 given the ones before it
        return sum(s.logprob for s in scores[len(prefix) - 1 :])

    return [list(await asyncio.gather(*(one(context, c) for c in choices))) for context, choices in items]


def score_mode(mode: str, items, model: str | None) -> list[list[float]]:
    quantization = mode if mode in ("int8", "int4") else None
    dtype = "float32" if quantization else mode
    engine = EngineCore(EngineConfig(model=model, dtype=dtype, quantization=quantization))
    engine.start()
    try:
        return asyncio.run(choice_logprobs(engine, engine.tokenizer, items))
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--modes", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    items = build_items()
    results = {mode: score_mode(mode, items, args.model) for mode in args.modes}
    reference = results.get("float32")
    picks = {mode: [max(range(len(row)), key=row.__getitem__) for row in rows] for mode, rows in results.items()}
    print(f"{len(items)} items, 4 choices each (right answer: index 0)")
    print(f"{'mode':10}{'accuracy':>10}{'same pick as fp32':>19}{'mean |dlogprob| vs fp32':>25}")
    summary = {}
    for mode, rows in results.items():
        accuracy = sum(p == 0 for p in picks[mode]) / len(items)
        agree = sum(a == b for a, b in zip(picks[mode], picks["float32"])) / len(items) if reference else float("nan")
        drift = statistics.mean(abs(a - b) for row, ref in zip(rows, reference) for a, b in zip(row, ref)) if reference else float("nan")
        summary[mode] = {"accuracy": accuracy, "agreement_with_fp32": agree, "mean_abs_logprob_diff": drift}
        print(f"{mode:10}{accuracy:10.3f}{agree:19.3f}{drift:25.4f}")
    if args.out:
        write_results(args.out, {"items": len(items), "summary": summary})


if __name__ == "__main__":
    main()
