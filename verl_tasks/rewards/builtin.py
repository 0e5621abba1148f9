"""Built-in scorers. Each returns 1.0 for a correct answer and the format score otherwise."""
from __future__ import annotations

import re
from typing import Any

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+")


def extract_gsm8k_answer(solution_str: str) -> str | None:
    """The last ``#### <number>`` in the final 300 characters, with commas and '$' removed."""
    tail = solution_str[-300:]
    matches = _GSM8K_ANSWER.findall(tail)
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


def gsm8k(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None,
    format_score: float = 0.0, score: float = 1.0,
) -> float:
    """verl's gsm8k rule: exact string match of the extracted answer."""
    answer = extract_gsm8k_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def exact_answer(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """1.0 when the response, stripped of whitespace, is exactly the ground truth."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def first_number(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """1.0 when the first number in the response equals the ground truth numerically."""
    match = _NUMBER.search(solution_str)
    if not match:
        return 0.0
    try:
        return 1.0 if float(match.group()) == float(ground_truth) else 0.0
    except ValueError:
        return 0.0


def last_integer(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """1.0 when the last integer in the response equals the ground truth (a chat model's "17 + 25 = 42."
    counts; "17 + 25 = 32." does not). Thousands separators are ignored."""
    found = _INTEGER.findall(solution_str.replace(",", ""))
    try:
        return 1.0 if found and int(found[-1]) == int(str(ground_truth).strip()) else 0.0
    except ValueError:  # a ground truth that is no integer: never matched
        return 0.0
