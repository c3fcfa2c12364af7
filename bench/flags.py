"""Flag checks shared by the benches: an error names the flag, the bad value and what is allowed."""

from __future__ import annotations


def check(flag: str, value, ok: bool, allowed: str):
    if not ok:
        raise SystemExit(f"error: {flag}={value!r} is invalid; allowed: {allowed}")
    return value


def int_list(flag: str, text: str, minimum: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag}={text!r} is not a comma-separated list of integers")
    if not values or min(values) < minimum:
        raise SystemExit(f"error: {flag}={text!r}: every value must be an integer >= {minimum}")
    return values
