"""Writes the miles_arith datasets: rows of NeMo Gym's JSONL format, one sum of two digits each.

``python create_examples.py`` (any Python 3) rewrites data/train.jsonl (each of the 100 sums
4 times, 400 rows, shuffled), data/eval.jsonl (each sum once, 100 rows) and data/example.jsonl
(the first 5 train rows, as NeMo Gym expects).

Train rows also carry ``teacher_answer``: a sloppy teacher's answer, the demonstrations of a
supervised warm start (the policy is shown only the row's input; the resources server ignores the
field). The teacher adds right, but ends an answer with a stray ``=`` with probability
``TEACHER_STRAY_RATE``, which the server's exact match scores 0: a model imitating it answers
mostly with the stray ``=``, and only the server's reward teaches it to stop after the digits.
"""
import json
import random
from pathlib import Path

TEACHER_STRAY_RATE = 0.6
COPIES = 4  # train rows per sum, each with its own teacher coin


def row(a: int, b: int, rng: random.Random | None = None) -> dict:
    out = {"responses_create_params": {"input": [{"role": "user", "content": f"{a}+{b}="}]},
           "expected_answer": str(a + b), "id": f"{a}+{b}"}
    if rng is not None:
        out["teacher_answer"] = str(a + b) + ("=" if rng.random() < TEACHER_STRAY_RATE else "")
    return out


def main() -> None:
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    train = [row(a, b, rng) for a, b in pairs for _ in range(COPIES)]
    for i, r in enumerate(train):
        r["id"] = f"{r['id']}#{i % COPIES}"
    rng.shuffle(train)
    data = Path(__file__).parent / "data"
    data.mkdir(exist_ok=True)
    for name, rows in (("train", train), ("eval", [row(a, b) for a, b in pairs]), ("example", train[:5])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
