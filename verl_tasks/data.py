"""Prompt data: the built-in arithmetic task, JSONL files and verl-format parquet.

Every source is normalised to rows ``{"id", "prompt", "ground_truth",
"data_source", "extra_info"}``; ``prompt`` is a string or a list of chat
messages. The normalised rows are pinned in the store on the first run, so a
file changed later cannot silently change a running experiment.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from verl_tasks.errors import DataError

BUILTIN_ARITH = "builtin:arith"
BUILTIN_ARITH_CHAT = "builtin:arith-chat"
ARITH_SOURCE = "arith"
OPERAND_RANGE = 100
CHAT_QUESTION = "What is {a}+{b}? Reply with the number only."


def arith_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All (a, b) pairs with 0 <= a, b < 100, split into (train, held-out) by a seeded shuffle."""
    pairs = [(a, b) for a in range(OPERAND_RANGE) for b in range(OPERAND_RANGE)]
    random.Random(f"arith-split-{seed}").shuffle(pairs)
    return pairs[1000:], pairs[:1000]


def arith_rows(seed: int, split: str, size: int, chat: bool = False) -> list[dict[str, Any]]:
    """The built-in problems: ``a+b=`` for the tiny model, or (``chat``) one user message for a chat model."""
    train, held_out = arith_pairs(seed)
    pool = train if split == "train" else held_out
    if size > len(pool):
        raise DataError(f"data.{split}_size {size} exceeds the {len(pool)} built-in {split} problems; lower it")
    return [
        {
            "id": f"arith-{split}-{a:02d}+{b:02d}",
            "prompt": [{"role": "user", "content": CHAT_QUESTION.format(a=a, b=b)}] if chat else f"{a}+{b}=",
            "ground_truth": str(a + b),
            "data_source": ARITH_SOURCE,
            "extra_info": {"a": a, "b": b},
        }
        for a, b in pool[:size]
    ]


def _row_from_record(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        for msg in prompt:
            if not (isinstance(msg, dict) and isinstance(msg.get("content"), str) and "role" in msg):
                raise DataError(f"{where}: 'prompt' chat messages need 'role' and string 'content'")
    elif not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: 'prompt' must be a non-empty string or a list of chat messages")
    truth = record.get("ground_truth")
    reward_model = record.get("reward_model")
    if truth is None and isinstance(reward_model, dict):
        truth = reward_model.get("ground_truth")
    if truth is None:
        raise DataError(f"{where}: no ground truth; give 'ground_truth' or 'reward_model.ground_truth'")
    extra = record.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra_info' must be an object")
    text_for_id = json.dumps([prompt, str(truth)], sort_keys=True)
    row_id = str(record.get("id") or extra.get("index") or hashlib.sha256(text_for_id.encode()).hexdigest()[:16])
    return {
        "id": row_id,
        "prompt": prompt,
        "ground_truth": str(truth),
        "data_source": str(record.get("data_source") or "unknown"),
        "extra_info": json.loads(json.dumps(extra, default=str)),
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [row for _where, row in _jsonl_rows(path)]


def _jsonl_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` per non-blank line; ``where`` is ``path:line``."""
    rows = []
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        number = raw[: err.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{number}: not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start}); "
            f"re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}); fix or remove "
                            f"the line") from None
        rows.append((f"{path}:{number}", _row_from_record(record, f"{path}:{number}")))
    return rows


def read_parquet(path: Path) -> list[dict[str, Any]]:
    return [row for _where, row in _parquet_rows(path)]


def _parquet_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    return [(f"{path} row {i}", _row_from_record(record, f"{path} row {i}"))
            for i, record in enumerate(table.to_pylist())]


def load_rows(source: str, split: str, seed: int, size: int) -> list[dict[str, Any]]:
    """Normalised rows of a data source; raises DataError naming the problem and the fix."""
    if source in (BUILTIN_ARITH, BUILTIN_ARITH_CHAT):
        located = [(f"{source} #{i}", row) for i, row in
                   enumerate(arith_rows(seed, split, size, chat=source == BUILTIN_ARITH_CHAT))]
    else:
        path = Path(source[len("file://") :] if source.startswith("file://") else source)
        if not path.is_file():
            raise DataError(f"data.{split}: file {path} does not exist")
        if path.suffix == ".parquet":
            located = _parquet_rows(path)
        elif path.suffix in (".jsonl", ".json"):
            located = _jsonl_rows(path)
        else:
            raise DataError(f"data.{split}: {path} must be .jsonl or .parquet")
    if not located:
        raise DataError(f"data.{split}: {source} holds no prompts; point it at a non-empty file")
    first: dict[str, str] = {}
    for where, row in located:
        if row["id"] in first:
            raise DataError(f"data.{split}: {where} repeats the prompt of {first[row['id']]} (id {row['id']!r}: "
                            f"an explicit 'id', or derived from the prompt and its ground truth); ids must be "
                            f"unique: remove the repeat or give each row its own 'id'")
        first[row["id"]] = where
    return [row for _where, row in located]


def prompt_text(prompt: str | list[dict[str, str]], tokenizer: Any) -> str:
    """The text fed to the model: chat messages go through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt) + "\nassistant: "
