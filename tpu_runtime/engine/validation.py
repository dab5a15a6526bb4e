"""Checks of what a user typed, shared by every family and by the CLI and the nodes: numbers against their rules,
sizes, frame counts. Each returns or raises a message that names the input, the rule and what would be
accepted."""

from __future__ import annotations

import math

from ..errors import InputError


def nearest_multiple(value, multiple: int) -> int:
    """The positive multiple of ``multiple`` nearest ``value`` (for error messages)."""
    try:
        return max(multiple, int(round(float(value) / multiple)) * multiple)
    except (TypeError, ValueError):
        return multiple


def size_problems(height, width, multiple: int, why: str = "") -> list[str]:
    """Messages for a height/width that is not a positive multiple of ``multiple``."""
    problems = []
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value <= 0 or value % multiple:
            problems.append(f"{name}={value} must be a positive multiple of {multiple}{why} "
                            f"(e.g. {nearest_multiple(value, multiple)})")
    return problems


def frame_problem(num_frames, rule: int, native: int, model: str) -> str | None:
    """A message for a frame count that is not ``rule * N + 1``, naming the nearest valid value."""
    if isinstance(num_frames, int) and num_frames >= 1 and (num_frames - 1) % rule == 0:
        return None
    try:
        k = max(0, round((float(num_frames) - 1) / rule))
    except (TypeError, ValueError):
        k = 0
    return (f"frames={num_frames} must be {rule}*N+1 for {model} "
            f"(e.g. {k * rule + 1} or {native}, the native length)")


def check_number(name: str, value, *, minimum=None, above=None, below=None, integer: bool = False,
                 optional: bool = False) -> None:
    """Refuse ``value`` unless it is a finite number (a whole one with ``integer``) >= ``minimum``, > ``above``
    and < ``below``; None is allowed when ``optional`` (the default is used). The message names the input and
    the rule."""
    if value is None and optional:
        return
    kind = "a whole number" if integer else "a number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    rules = []
    if minimum is not None:
        rules.append(f"at least {minimum}")
        ok = ok and value >= minimum
    if above is not None:
        rules.append(f"above {above}")
        ok = ok and value > above
    if below is not None:
        rules.append(f"below {below}")
        ok = ok and value < below
    if not ok:
        leave = " (leave it out for the model's default)" if optional else ""
        given = f"{name} {value}" if name.startswith("--") else f"{name}={value}"  # as the user wrote it
        raise InputError(f"{given} must be {kind} {' and '.join(rules)}{leave}")


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise InputError("; ".join(problems))
