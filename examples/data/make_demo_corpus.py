"""Writes the demo corpora of examples/data/: `alpaca_demo.json` (Alpaca rows: instruction,
input, output) and `chat_demo.jsonl` (messages rows: system prompts, up to three turns, and, in
about a third of the conversations, the assistant's reasoning).

Every row is composed here from the phrase tables of demo_phrases.py; nothing is downloaded or
copied from a dataset. The mix is shaped like a real SFT corpus: one-word labels, single facts
and worked arithmetic next to numbered tips, how-to steps, code, stories and essays with a long
tail (answers from 1 to ~600 tokens, median ~70); over a third of the Alpaca rows carry an
input; no row repeats. Only `random.Random(seed).random()` is drawn (Python keeps its sequence
for a seed across versions), so a seed writes byte-identical files on every machine;
tests/unit/data/test_demo_corpus.py checks that the committed files are this script's output.

    python examples/data/make_demo_corpus.py                    # rewrites both files (seed 0)
    python examples/data/make_demo_corpus.py --out-dir /tmp/demo --rows 5000 --seed 7
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import demo_phrases as P

HERE = Path(__file__).resolve().parent
ALPACA_FILE = "alpaca_demo.json"
CHAT_FILE = "chat_demo.jsonl"

Row = tuple[str, str, str, str]  # instruction, input, output, reasoning
Snippet = tuple[str, str, str, str, str]  # what it does, code, example call, its result, a note
T = TypeVar("T")


class Draw:
    """Choices driven by `random()` only (randint/choice/gauss may change between versions)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def uniform(self) -> float:
        return self._rng.random()

    def chance(self, p: float) -> bool:
        return self._rng.random() < p

    def int_in(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        return lo + int(self._rng.random() * (hi - lo + 1))

    def pick(self, items: Sequence[T]) -> T:
        return items[int(self._rng.random() * len(items))]

    def sample(self, items: Sequence[T], k: int) -> list[T]:
        """k distinct items, in drawn order."""
        pool = list(items)
        return [pool.pop(int(self._rng.random() * len(pool))) for _ in range(min(k, len(pool)))]

    def lognormal(self, median: float, sigma: float) -> float:
        # Box-Muller from two random() draws.
        u1 = max(self._rng.random(), 1e-12)
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * self._rng.random())
        return median * math.exp(sigma * z)


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _uncap(text: str) -> str:
    return text[0].lower() + text[1:]


def _title(text: str) -> str:
    small = {"a", "an", "the", "of", "and", "in", "on", "for", "to", "with"}
    words = text.split()
    return " ".join(w if i and w in small else _cap(w) for i, w in enumerate(words))


def _sentence(d: Draw, template: str, topic: str, field: str) -> str:
    slots = {name: d.pick(values) for name, values in P.SLOTS.items()}
    return _cap(template.format(t=topic, f=field, **slots))


def _paragraphs(d: Draw, topic: str, field: str, words: int) -> list[list[str]]:
    """Expository paragraphs (lists of sentences) of about `words` words, three to six sentences
    each; no template repeats until all of them have been used."""
    paragraphs: list[list[str]] = [[_sentence(d, d.pick(P.OPENINGS), topic, field)]]
    unused: list[str] = []
    count = 0
    while count < words:
        if len(paragraphs[-1]) >= d.int_in(3, 6):
            paragraphs.append([])
        unused = unused or d.sample(P.BODY, len(P.BODY))
        paragraphs[-1].append(_sentence(d, unused.pop(), topic, field))
        count += paragraphs[-1][-1].count(" ") + 1
    if len(paragraphs) > 1 or d.chance(0.3):
        paragraphs.append([_sentence(d, d.pick(P.CLOSINGS), topic, field)])
    return paragraphs


def _text(paragraphs: list[list[str]]) -> str:
    return "\n\n".join(" ".join(p) for p in paragraphs)


def essay(d: Draw) -> Row:
    topic, field = d.pick(P.TOPICS)
    words = int(min(max(d.lognormal(140.0, 0.7), 25.0), 500.0))
    text = _text(_paragraphs(d, topic, field, words))
    u = d.uniform()
    if u < 0.2:
        return d.pick(P.TOPIC_INPUT_TASKS), _cap(topic), text, ""
    if u < 0.35:
        sentence = _sentence(d, d.pick(P.BODY), topic, field)
        return d.pick(P.EXPAND_TASKS), sentence, f"{sentence} {text}", ""
    return _cap(d.pick(P.ESSAY_TASKS).format(t=topic, f=field)), "", text, ""


def summary(d: Draw) -> Row:
    topic, field = d.pick(P.TOPICS)
    paragraphs = _paragraphs(d, topic, field, d.int_in(50, 180))
    text = _text(paragraphs)
    if d.chance(0.35):
        title = _title(d.pick(P.TITLES).format(t=topic, f=field))
        return "Generate a title for the following text.", text, title, ""
    sentences = [s for p in paragraphs for s in p]
    out = f"The text says that {_uncap(sentences[0])}"
    statements = [s for s in sentences[1:] if not s.startswith(("To get", "If you"))]
    if statements and d.chance(0.6):
        out += f" It also mentions that {_uncap(d.pick(statements))}"
    return d.pick(P.SUMMARY_TASKS), text, out, ""


def tips(d: Draw) -> Row:
    activity = d.pick(P.ACTIVITIES)
    n = d.int_in(3, 10)
    instruction = d.pick(P.TIP_TASKS).format(n=n, a=activity)
    items = d.sample(P.TIPS, n)
    numbered = d.chance(0.7)
    lines = [
        f"{i}. {head}: {body}" if numbered else f"- {head}. {body}"
        for i, (head, body) in enumerate(items, 1)
    ]
    out = "\n".join(lines)
    if d.chance(0.7):
        out = f"Here are {n} tips for {activity}:\n\n{out}"
    if d.chance(0.4):
        out += "\n\n" + d.pick(P.TIP_OUTROS)
    return instruction, "", out, ""


def how_to(d: Draw) -> Row:
    process, steps = d.pick(P.PROCESSES)
    instruction = d.pick(P.HOW_TO_TASKS).format(p=process)
    lines = [f"{i}. {step}" for i, step in enumerate(steps, 1)]
    out = f"{d.pick(P.HOW_TO_INTROS).format(p=process)}\n\n" + "\n".join(lines)
    if d.chance(0.5):
        out += "\n\n" + d.pick(P.HOW_TO_OUTROS)
    return instruction, "", out, ""


def classify(d: Draw) -> Row:
    tasks, examples = d.pick(P.CLASSIFY)
    task, (item, label) = d.pick(tasks), d.pick(examples)
    if d.chance(0.5):
        return task, item, label, f"{item} belongs to the category {label.lower()}."
    if tasks is P.CLASSIFY[-1][0]:  # sentiment
        out = f"The sentiment of this sentence is {label.lower()}."
    else:
        out = f"{_cap(_article(item))} {item.lower()} is {_article(label)} {label.lower()}."
    return task, item, out, f"Looking at the input: {item} The answer is {label.lower()}."


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def fact(d: Draw) -> Row:
    country, capital, continent = d.pick(P.COUNTRIES)
    if d.chance(0.6):
        question = d.pick(P.CAPITAL_TASKS).format(c=country)
        out = capital if d.chance(0.3) else f"The capital of {country} is {capital}."
        return question, "", out, f"The capital of {country} is {capital}."
    out = f"{country} is in {continent}."
    return f"On which continent is {country}?", "", out, out


def arithmetic(d: Draw) -> Row:
    kind = d.pick(("product", "area", "average", "temperature"))
    if kind == "product":
        a, b = d.int_in(11, 99), d.int_in(3, 49)
        out = f"{a} multiplied by {b} is {a * b}."
        tens, ones = b // 10 * 10, b % 10
        why = f"{a} × {tens} = {a * tens}, plus {a} × {ones} = {a * ones}, gives {a * b}."
        if not tens or not ones:
            why = f"{a} × {b} = {a * b}."
        return f"What is {a} multiplied by {b}?", "", out, why
    if kind == "area":
        a, b = d.int_in(2, 40), d.int_in(2, 40)
        out = (
            "The area of a rectangle is its length times its width:\n\n"
            f"Area = {a} cm × {b} cm = {a * b} cm²\n\nSo the area is {a * b} square centimeters."
        )
        task = f"Calculate the area of a rectangle with a length of {a} cm and a width of {b} cm."
        return task, "", out, f"Length times width: {a} × {b} = {a * b}."
    if kind == "average":
        values = [d.int_in(1, 99) for _ in range(d.int_in(3, 8))]
        total, n = sum(values), len(values)
        mean = f"{total / n:.2f}".rstrip("0").rstrip(".")
        equals = "=" if total * 100 % n == 0 else "≈"  # two decimals hold the mean exactly
        out = (
            f"The numbers add up to {total} and there are {n} of them, so the average "
            f"is {total} / {n} {equals} {mean}."
        )
        numbers = ", ".join(map(str, values))
        return "Find the average of the following numbers.", numbers, out, f"Sum {total}."
    c = d.int_in(-20, 45)
    f = f"{c * 9 / 5 + 32:.1f}".removesuffix(".0")
    out = f"To convert Celsius to Fahrenheit, multiply by 9/5 and add 32:\n\n{c} × 9/5 + 32 = {f}"
    out += f"\n\nSo {c} °C is {f} °F."
    return f"Convert {c} degrees Celsius to Fahrenheit.", "", out, f"{c} × 1.8 + 32 = {f}."


def edit(d: Draw) -> Row:
    tasks, pairs = d.pick(P.EDITS)
    task, (before, after) = d.pick(tasks), d.pick(pairs)
    return task, before, after, f"Same meaning, fixed wording: {after}"


def translate(d: Draw) -> Row:
    phrase, *versions = d.pick(P.PHRASES)
    i = d.int_in(0, len(P.LANGUAGES) - 1)
    language = P.LANGUAGES[i]
    if d.chance(0.5):
        return f"Translate the following sentence into {language}.", phrase, versions[i], ""
    out = f'In {language}, "{phrase}" is "{versions[i]}".'
    return f'How do you say "{phrase}" in {language}?', "", out, ""


def _factorial(d: Draw) -> Snippet:
    n = d.int_in(3, 10)
    body = (
        "def factorial(n):\n"
        "    result = 1\n"
        "    for i in range(2, n + 1):\n"
        "        result *= i\n"
        "    return result"
    )
    note = "The loop multiplies the numbers from 2 to n; factorial(0) and factorial(1) return 1."
    return (
        "returns the factorial of a number",
        body,
        f"factorial({n})",
        str(math.factorial(n)),
        note,
    )


def _palindrome(d: Draw) -> Snippet:
    word = d.pick(["level", "python", "racecar", "banana", "noon", "kayak", "planet"])
    body = (
        "def is_palindrome(text):\n"
        "    cleaned = ''.join(ch.lower() for ch in text if ch.isalnum())\n"
        "    return cleaned == cleaned[::-1]"
    )
    note = "Spaces and punctuation are ignored, so whole sentences can be checked too."
    result = str(word == word[::-1])
    return "checks whether a string is a palindrome", body, f"is_palindrome('{word}')", result, note


def _vowels(d: Draw) -> Snippet:
    text = d.pick(["hello world", "machine learning", "open source", "banana bread"])
    body = "def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in 'aeiou')"
    note = "Uppercase letters are counted as well, because the text is lowercased first."
    count = str(sum(ch in "aeiou" for ch in text))
    return "counts the vowels in a string", body, f"count_vowels('{text}')", count, note


def _celsius(d: Draw) -> Snippet:
    c = d.int_in(-10, 40)
    body = "def celsius_to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32"
    note = "The formula multiplies by 9/5 and adds 32."
    call = f"celsius_to_fahrenheit({c})"
    return "converts Celsius to Fahrenheit", body, call, repr(c * 9 / 5 + 32), note


def _fibonacci(d: Draw) -> Snippet:
    n = d.int_in(5, 12)
    body = (
        "def fibonacci(n):\n"
        "    numbers = [0, 1]\n"
        "    while len(numbers) < n:\n"
        "        numbers.append(numbers[-1] + numbers[-2])\n"
        "    return numbers[:n]"
    )
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    note = "Each new number is the sum of the two before it."
    what = "returns the first n Fibonacci numbers"
    return what, body, f"fibonacci({n})", str(seq[:n]), note


def _reverse_words(d: Draw) -> Snippet:
    text = d.pick(["the quick brown fox", "hello there world", "packing saves compute"])
    body = "def reverse_words(sentence):\n    return ' '.join(reversed(sentence.split()))"
    note = "split() also collapses repeated spaces between words."
    result = repr(" ".join(reversed(text.split())))
    return (
        "reverses the order of words in a sentence",
        body,
        f"reverse_words('{text}')",
        result,
        note,
    )


FUNCTIONS: list[tuple[str, Callable[[Draw], Snippet]]] = [
    ("factorial", _factorial),
    ("is_palindrome", _palindrome),
    ("count_vowels", _vowels),
    ("celsius_to_fahrenheit", _celsius),
    ("fibonacci", _fibonacci),
    ("reverse_words", _reverse_words),
]


def code(d: Draw) -> Row:
    name, make = d.pick(FUNCTIONS)
    what, body, call, result, note = make(d)
    instruction = d.pick(P.CODE_TASKS).format(w=what)
    out = f"Here is a Python function that {what}:\n\n```python\n{body}\n```"
    example = d.chance(0.7)
    if example:
        out += f"\n\nFor example, `{call}` returns `{result}`."
    if d.chance(0.6):
        out += f" {note}" if example and d.chance(0.5) else f"\n\n{note}"
    return instruction, "", out, f"A short function named {name} is enough."


def story(d: Draw) -> Row:
    who, where = d.pick(P.CHARACTERS), d.pick(P.PLACES)
    event, lesson = d.pick(P.EVENTS), d.pick(P.LESSONS)
    instruction = d.pick(P.STORY_TASKS).format(c=who, e=event)
    chosen = sorted(d.sample(range(len(P.STORY_MIDDLE)), d.int_in(2, len(P.STORY_MIDDLE))))
    middle = [P.STORY_MIDDLE[i] for i in chosen]  # in table order, which is story order
    parts = [
        f"Once upon a time, {who} lived in {where}.",
        d.pick(P.STORY_ROUTINES),
        f"One day, the {who.split(' ', 1)[1]} {event}.",
        *middle,
        f"In the end, they understood that {lesson}.",
    ]
    cut = 2 + d.int_in(1, max(1, len(parts) - 3))
    out = " ".join(parts[:cut]) + "\n\n" + " ".join(parts[cut:])
    return instruction, "", out, ""


# Weights follow the task mix of public instruction sets: mostly short answers and explanations.
TASKS: list[tuple[Callable[[Draw], Row], float]] = [
    (essay, 0.22),
    (summary, 0.10),
    (tips, 0.14),
    (how_to, 0.08),
    (classify, 0.11),
    (fact, 0.08),
    (arithmetic, 0.10),
    (edit, 0.07),
    (translate, 0.04),
    (code, 0.04),
    (story, 0.04),
]


def _task(d: Draw) -> Row:
    u, acc = d.uniform() * sum(w for _, w in TASKS), 0.0
    for make, weight in TASKS:
        acc += weight
        if u < acc:
            return make(d)
    return TASKS[-1][0](d)


def _new_task(d: Draw, seen: set[tuple[str, str, str]]) -> Row:
    """A task whose (instruction, input, output) is not in `seen` (redrawn, as a real corpus is
    deduplicated); after 100 tries the last draw is kept."""
    for _ in range(100):
        row = _task(d)
        if row[:3] not in seen:
            break
    seen.add(row[:3])
    return row


def alpaca_rows(*, rows: int = 1000, seed: int = 0) -> list[dict[str, str]]:
    """`rows` distinct Alpaca dicts; equal (rows, seed) give equal rows."""
    d, seen = Draw(seed), set()
    out = []
    for _ in range(rows):
        instruction, context, output, _ = _new_task(d, seen)
        out.append({"instruction": instruction, "input": context, "output": output})
    return out


def chat_rows(*, rows: int = 200, seed: int = 0) -> list[dict]:
    """`rows` conversations (messages): 1-3 turns, a system prompt in ~40%, reasoning in ~1/3."""
    d, seen = Draw(seed + 1), set()  # another stream than the Alpaca rows of the same seed
    out = []
    for _ in range(rows):
        messages: list[dict[str, str]] = []
        if d.chance(0.4):
            messages.append({"role": "system", "content": d.pick(P.SYSTEM_PROMPTS)})
        thinking = d.chance(0.33)
        for turn in range(d.pick((1, 1, 1, 2, 2, 3))):
            instruction, context, answer, reasoning = _new_task(d, seen)
            prompt = f"{instruction}\n\n{context}" if context else instruction
            if turn and d.chance(0.5):
                prompt = f"{d.pick(P.FOLLOW_UPS)} {prompt}"
            messages.append({"role": "user", "content": prompt})
            reply = {"role": "assistant", "content": answer}
            if thinking:
                plan = reasoning or d.pick(P.PLANS).format(t=instruction)
                reply = {"role": "assistant", "reasoning_content": plan, "content": answer}
            messages.append(reply)
        out.append({"messages": messages})
    return out


def write(out_dir: Path, *, rows: int, chat: int, seed: int) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    alpaca = out_dir / ALPACA_FILE
    alpaca.write_text(
        json.dumps(alpaca_rows(rows=rows, seed=seed), ensure_ascii=False, indent=2) + "\n",
        encoding="utf-8",
    )
    conversations = out_dir / CHAT_FILE
    lines = [json.dumps(r, ensure_ascii=False) for r in chat_rows(rows=chat, seed=seed)]
    conversations.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [alpaca, conversations]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=HERE, help="default: %(default)s")
    parser.add_argument("--rows", type=int, default=1000, help="Alpaca rows (default 1000)")
    parser.add_argument("--chat-rows", type=int, default=200, help="conversations (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    args = parser.parse_args(argv)
    for path in write(args.out_dir, rows=args.rows, chat=args.chat_rows, seed=args.seed):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
