"""Deterministic text for the app workloads: documents, a long system prompt, user questions. No downloads.

Plain English built from fixed phrases by a seeded generator. Each (app, mode, repeat) gets its own
seed, so no run is sped up by KV blocks another run left in an engine's prefix cache, while every
run sees text of the same size and shape.
"""

from __future__ import annotations

import random

_PLACES = ["Aldermere", "Brackenford", "Coldharbour", "Dunmore", "Eastwick", "Fernhollow", "Greyhaven",
           "Highmoor", "Ivybridge", "Juniper Bay"]
_SUBJECTS = ["The town council", "The harbour master", "A group of farmers", "The local school",
             "The river authority", "Most shopkeepers", "The railway company", "Several fishermen",
             "The mayor's office", "A visiting engineer", "The weather station", "The public library"]
_VERBS = ["reported", "planned", "questioned", "repaired", "measured", "recorded", "proposed", "delayed",
          "funded", "inspected", "rebuilt", "surveyed"]
_OBJECTS = ["the old stone bridge", "the northern sea wall", "the spring harvest", "the water supply",
            "the winter timetable", "the market square", "the flood defences", "the new footpath",
            "the fishing quotas", "the school roof", "the lighthouse lamp", "the grain stores"]
_CLAUSES = ["after a wet autumn", "before the summer festival", "despite a shortage of funds",
            "with help from volunteers", "at a cost of about four thousand pounds", "for the third year running",
            "following complaints from residents", "ahead of the spring tides", "while the road was closed",
            "as the population grew"]

_TOPICS = ["billing", "refunds", "shipping", "account security", "returns", "warranties", "subscriptions",
           "privacy", "gift cards", "business accounts", "loyalty points", "accessibility"]
_RULES = ["Always greet the customer politely and answer in plain, short sentences about {topic}.",
          "Never promise a {topic} outcome that the written policy does not allow.",
          "When a question about {topic} is unclear, ask one short clarifying question first.",
          "For {topic}, quote the relevant policy section number when you rely on it.",
          "Escalate {topic} cases older than thirty days to a human supervisor.",
          "Do not ask for full card numbers or passwords when discussing {topic}.",
          "If a {topic} request needs identity checks, explain the two-step verification process.",
          "Summarize the agreed next step on {topic} at the end of your answer."]
_QUESTIONS = ["How do I get a refund for a damaged item?", "Can I change my delivery address?",
              "Why was I charged twice this month?", "How do I reset my password?",
              "Do you ship to Norway?", "How long is the warranty on headphones?",
              "Can I cancel my subscription today?", "Where are my loyalty points?",
              "Is my gift card still valid?", "How do I close my account?"]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_CLAUSES)}."


def document(seed: int, chunks: int, words_per_chunk: int) -> list[str]:
    """A report split into ``chunks`` parts of about ``words_per_chunk`` words each."""
    rng = random.Random(seed)
    place = f"{rng.choice(_PLACES)} (report {seed})"
    parts = []
    for index in range(chunks):
        sentences = [f"Part {index + 1} of the yearly report on {place}."]
        words = len(sentences[0].split())
        while words < words_per_chunk:
            sentences.append(_sentence(rng))
            words += len(sentences[-1].split())
        parts.append(" ".join(sentences))
    return parts


def system_prompt(seed: int, words: int) -> str:
    """A support assistant's long instructions (SmolLM2's tokenizer: about 1.45 tokens a word)."""
    rng = random.Random(seed)
    lines = [f"You are the customer support assistant of Northwind Goods, policy edition {seed}. "
             "Follow every rule below when you answer."]
    count = len(lines[0].split())
    while count < words:
        rule = f"Rule {len(lines)}. " + rng.choice(_RULES).format(topic=rng.choice(_TOPICS))
        lines.append(rule)
        count += len(rule.split())
    return "\n".join(lines)


def questions(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [f"(customer {index + 1}) {rng.choice(_QUESTIONS)}" for index in range(count)]
