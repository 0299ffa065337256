"""Build the local lm-eval data files of `eval/lm_eval_tasks/` from the held-out stdlib split.

    python -m eval.build_lm_eval_data [--model checkpoints/tiny-mimo-trained] [--n 300]

Two JSONL files, one document per line, from the held-out files of `eval.corpus.corpus_split`
(never seen in training, tokenizer included), with a fixed seed:

- `next_line_gen.jsonl` (task `mimo_next_line_gen`): a code context (whole preceding lines,
  160..384 tokens) and the next line; the model greedily generates up to the first newline and
  is scored by exact match. The context ends with the newline and the next line's indentation
  minus one space, and the target is the rest (" " + text, or just the text at top level), so
  the prompt is tokenized exactly as the same text is inside the file: byte-level BPE glues
  the last indentation space to the word after it (`"\\n   "`, `" return"`).
- `next_line_choice.jsonl` (task `mimo_next_line_choice`): the same kind of context and four
  candidate lines, the true one and three other lines of the same file (with the true line's
  indentation when the file has enough of them, and of similar length, so that the summed
  loglikelihood does not just pick the shortest line), in random order; scored by
  loglikelihood (acc, chance 25%). lm-eval moves the context's trailing newline into each
  continuation.

Documents whose prompt tokens are not a prefix of the tokens of prompt + target are dropped.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TASK_DIR = Path(__file__).with_name("lm_eval_tasks")
DATA_DIR = TASK_DIR / "data"
GEN_FILE = "next_line_gen.jsonl"
CHOICE_FILE = "next_line_choice.jsonl"
MIN_CONTEXT_TOKENS = 160
MAX_CONTEXT_TOKENS = 384
MAX_CONTEXT_CHARS = 1600
MIN_LINE_CHARS = 4  # stripped
MAX_LINE_CHARS = 100


def _usable(line: str) -> bool:
    body = line.strip()
    indent = line[: len(line) - len(line.lstrip())]
    return MIN_LINE_CHARS <= len(body) <= MAX_LINE_CHARS and "\t" not in indent and "\t" not in body


def _context(lines: list[str], j: int, tok) -> str | None:
    """Whole lines before line j, as many as fit in the token / character budget."""
    start = j
    chars = 0
    while start > 0 and chars + len(lines[start - 1]) + 1 <= MAX_CONTEXT_CHARS:
        start -= 1
        chars += len(lines[start]) + 1
    while start < j:
        text = "\n".join(lines[start:j]) + "\n"
        n = len(tok.encode(text).ids)
        if n <= MAX_CONTEXT_TOKENS:
            return text if n >= MIN_CONTEXT_TOKENS else None
        start += 1
    return None


def _load(files: list[Path], root: Path) -> list[tuple[str, list[str]]]:
    from eval.train_tiny import read_text

    return [(str(p.relative_to(root)), [line.rstrip() for line in read_text(p).splitlines()]) for p in files]


def _line_contexts(docs, tok, rng: random.Random):
    """(file name, its lines, line index, context) for each usable line, in a seeded order."""
    candidates = [(fi, j) for fi, (_, lines) in enumerate(docs) for j in range(len(lines)) if _usable(lines[j])]
    rng.shuffle(candidates)
    for fi, j in candidates:
        name, lines = docs[fi]
        ctx = _context(lines, j, tok)
        if ctx is not None:
            yield name, lines, j, ctx


def build_gen(docs, tok, n: int, seed: int) -> list[dict]:
    out = []
    for name, lines, j, ctx in _line_contexts(docs, tok, random.Random(seed)):
        if len(out) >= n:
            break
        line = lines[j]
        indent = line[: len(line) - len(line.lstrip())]
        context = ctx + indent[:-1]
        target = line[len(indent) - 1 :] if indent else line
        ids_ctx = tok.encode(context).ids
        ids_all = tok.encode(context + target).ids
        if ids_all[: len(ids_ctx)] != ids_ctx:
            continue
        out.append({"id": f"gen-{len(out):04d}", "file": name, "line": j + 1, "context": context, "target": target})
    return out


def build_choice(docs, tok, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for name, lines, j, ctx in _line_contexts(docs, tok, rng):
        if len(out) >= n:
            break
        true = lines[j]
        indent = true[: len(true) - len(true.lstrip())]
        seen = {true.strip()}
        pool = []
        for k, other in enumerate(lines):
            if k != j and _usable(other) and other.strip() not in seen:
                seen.add(other.strip())
                pool.append(other)
        same = [line for line in pool if line[: len(line) - len(line.lstrip())] == indent]
        pool = same if len(same) >= 3 else pool
        if len(pool) < 3:
            continue
        # Similar length (2/3 .. 3/2 of the true line), so a summed loglikelihood cannot win by
        # preferring short lines; else the 3 closest in length.
        size = len(true.strip())
        near = [line for line in pool if 2 / 3 <= len(line.strip()) / size <= 3 / 2]
        if len(near) >= 3:
            distractors = rng.sample(near, 3)
        else:
            distractors = sorted(pool, key=lambda line: abs(len(line.strip()) - size))[:3]
        choices = distractors + [true]
        rng.shuffle(choices)
        out.append(
            {
                "id": f"choice-{len(out):04d}",
                "file": name,
                "line": j + 1,
                "context": ctx,
                "choices": choices,
                "label": choices.index(true),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.build_lm_eval_data", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/tiny-mimo-trained", help="model folder whose tokenizer.json measures contexts")
    p.add_argument("--n", type=int, default=300, help="documents per task")
    p.add_argument("--seed", type=int, default=5, help="sampling seed")
    p.add_argument("--out", default=str(DATA_DIR), help="folder for the JSONL files")
    args = p.parse_args(argv)

    from tokenizers import Tokenizer

    from eval.corpus import corpus_split, stdlib_root

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    _, held = corpus_split()
    docs = _load(held, stdlib_root())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fname, rows in (
        (GEN_FILE, build_gen(docs, tok, args.n, args.seed)),
        (CHOICE_FILE, build_choice(docs, tok, args.n, args.seed + 1)),
    ):
        with open(out / fname, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} documents to {out / fname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
