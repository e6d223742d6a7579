"""Rule-based reward for math answers: extract the final answer, compare it with the reference.

Comparison: equal after normalisation, or equal as exact rationals (``1,000`` = ``1000``,
``3/4`` = ``0.75`` = ``\\frac{3}{4}``, ``-5.`` = ``-5``, ``$12`` = ``12 dollars``); past that,
``math_verify`` (``pip install lightning-logra[math]``) decides symbolic equivalence when it
is installed. Its own signal-based timeouts are on where they can work, in a main thread
(``RewardRunner`` runs this function in a worker process's main thread), and off in any
other thread, where the runner's timeout is the only limit.

Neither comparison ever computes an unbounded number: an answer with a number of more than
``MAX_DIGITS`` digits, an exponent (``1e...``, ``^``, ``**``) past ``MAX_EXPONENT`` or
holding another power (``10^{10^{10}}``), or a factorial past ``MAX_EXPONENT!`` matches only
a reference that reads the same. One such big-integer operation holds the GIL for minutes,
which no timeout in a thread can interrupt.

``math_reward`` follows TRL's reward convention, ``fn(completions, **kwargs)`` with the
reference answers in the ``answer`` column, and still accepts the older positional call
``math_reward(completions, answers)``. An old function ``fn(completions, answers)`` of your
own becomes TRL-style by renaming the parameter and accepting the other columns:
``def fn(completions, answer, **kwargs)``; if its completions may be conversational, read
their text with ``completion_text``.
"""

import logging
import re
import threading
from fractions import Fraction

from lightning_logra.rewards.completions import completion_text

try:
    import math_verify
except ImportError:  # optional extra
    math_verify = None


def _not_timeout_disabled_notice(record: logging.LogRecord) -> bool:
    """Drops math_verify's one-time "Timeout is disabled as ..." notice, which its
    ``parse``/``verify`` log when called with ``parsing_timeout=None``/``timeout_seconds=None``
    as here (deliberately: see the module docstring); its other messages pass."""
    return not record.getMessage().startswith("Timeout is disabled as ")


if math_verify is not None:
    for _name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(_name).addFilter(_not_timeout_disabled_notice)

NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# A number followed by unit words of two or more letters ("12 dollars", "5 cm", not "2 x").
NUMBER_WITH_UNITS = re.compile(r"(?P<number>[-\d.,/]+)(?:\s+[a-zA-Z]{2,})+")
FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\^\{?\\circ\}?|\\%|%|\\\$|\$")
# Bounds on the numbers a comparison computes with (see the module docstring).
MAX_DIGITS = 1000
MAX_EXPONENT = 1000
DIGITS = re.compile(r"\d+")
SCIENTIFIC_EXPONENT = re.compile(r"\d\.?\s*[eE]\s*[-+]?\s*(\d+)")
POWER = re.compile(r"\^|\*\*")
FACTORIAL = re.compile(r"(\d+)\s*!")
# A power raised again, "10**10**10" (right-associative: a tower) or "a^b^c".
POWER_CHAIN = re.compile(r"(?:\^|\*\*)\s*(?:\{[^{}]*\}|\([^()]*\)|[-+]?[\w.]+)\s*(?:\^|\*\*)")


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when it gives none.

    In order of preference: the last ``\\boxed{...}`` (nested braces allowed), the last GSM8K
    ``#### answer`` line, the last "the answer is ..." sentence, the last number.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    gsm8k = re.findall(r"####\s*([^\n]*\S)", text)
    if gsm8k:
        return _strip_wrappers(gsm8k[-1])
    stated = re.findall(r"answer is\s*:?\s*([^\n]*\S)", text, flags=re.IGNORECASE)
    if stated:
        # Up to the first sentence end: a period followed by a space or the line end.
        return _strip_wrappers(re.split(r"\.(?:\s|$)", stated[-1])[0])
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def answers_match(predicted: str, reference: str) -> bool:
    """Whether two extracted answers are the same (see the module docstring)."""
    predicted, reference = _normalize(predicted), _normalize(reference)
    if predicted == reference:
        return True
    predicted_number, reference_number = _to_number(predicted), _to_number(reference)
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    if math_verify is None or not (bounded(predicted) and bounded(reference)):
        return False
    # math_verify's own timeouts (its defaults) use SIGALRM, which only a main thread receives.
    on_main_thread = threading.current_thread() is threading.main_thread()
    parsing = {} if on_main_thread else {"parsing_timeout": None}
    verifying = {} if on_main_thread else {"timeout_seconds": None}
    gold = math_verify.parse(f"${reference}$", **parsing)
    answer = math_verify.parse(f"${predicted}$", **parsing)
    return bool(gold) and bool(answer) and math_verify.verify(gold, answer, **verifying)


def bounded(answer: str) -> bool:
    """Whether every number ``answer`` spells out stays within ``MAX_DIGITS`` digits, its
    exponents within ``MAX_EXPONENT`` (no power inside an exponent) and its factorials
    within ``MAX_EXPONENT!``: whether computing it takes milliseconds."""
    if any(len(digits) > MAX_DIGITS for digits in DIGITS.findall(answer)):
        return False
    if any(int(exponent) > MAX_EXPONENT for exponent in SCIENTIFIC_EXPONENT.findall(answer)):
        return False
    if any(int(number) > MAX_EXPONENT for number in FACTORIAL.findall(answer)) or POWER_CHAIN.search(answer):
        return False
    for power in POWER.finditer(answer):
        exponent = _operand(answer, power.end())
        if POWER.search(exponent) or any(int(n) > MAX_EXPONENT for n in DIGITS.findall(exponent)):
            return False
    return True


def math_reward(completions: list, answers: list | None = None, *, answer: list | None = None, **kwargs) -> list:
    """1.0 where a completion's final answer equals the reference answer, else 0.0; None
    where the reference is None (a row of another task, which this reward does not score).

    Completions are strings or conversational (``[{"role": "assistant", "content": ...}]``).
    The references come as ``answer=`` (TRL style, as ``RewardRunner`` passes the dataset
    column) or positionally as ``answers``; other columns in ``kwargs`` are ignored. A
    reference that is a full GSM8K solution (``... #### 72``) or contains ``\\boxed`` is
    reduced to its final answer first.
    """
    references = _references(answers, answer)
    if len(completions) != len(references):
        raise ValueError(f"got {len(completions)} completions but {len(references)} answers")
    return [
        None if reference is None else _score(_text_of(completions, index), str(reference))
        for index, reference in enumerate(references)
    ]


def _references(answers: list | None, answer: list | None) -> list:
    if answers is not None and answer is not None:
        raise TypeError("math_reward: pass the references as answer= or positionally as answers, not both")
    if answers is None and answer is None:
        raise TypeError("math_reward needs the reference answers: answer=[...] (the dataset's 'answer' column)")
    return answers if answer is None else answer


def _text_of(completions: list, index: int) -> str:
    try:
        return completion_text(completions[index])
    except TypeError:
        kind = type(completions[index]).__name__
        raise TypeError(f"completions[{index}] is {kind}, expected str or a list of messages") from None


def _score(completion: str, reference: str) -> float:
    if "####" in reference or "\\boxed" in reference:
        reference = extract_answer(reference) or reference
    predicted = extract_answer(completion)
    return 1.0 if predicted is not None and answers_match(predicted, reference) else 0.0


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0 or text[start:opening].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for position in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[opening + 1 : position]
    return None  # unbalanced: a truncated completion


def _strip_wrappers(answer: str) -> str:
    return answer.strip().rstrip(".").strip().strip("$").strip()


def _normalize(answer: str) -> str:
    answer = LATEX_TEXT.sub(r"\1", answer)
    answer = LATEX_NOISE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    answer = answer.rsplit("=", 1)[-1]  # "x = 5" -> "5"
    return " ".join(answer.split()).rstrip(".").strip().lower()


def _operand(text: str, start: int) -> str:
    """The exponent that starts at ``start``: a ``{...}`` or ``(...)`` group (to its closing
    bracket, or the text's end), else the run of word characters, dots and signs there."""
    text = text[start:].lstrip()
    if text[:1] in ("{", "("):
        opening, closing = text[0], "}" if text[0] == "{" else ")"
        depth = 0
        for position, character in enumerate(text):
            depth += (character == opening) - (character == closing)
            if depth == 0:
                return text[1:position]
        return text
    return re.match(r"[-+]?[\w.\\]*", text)[0]


def _to_number(answer: str) -> Fraction | None:
    with_units = NUMBER_WITH_UNITS.fullmatch(answer)
    if with_units:
        answer = with_units["number"]
    answer = answer.replace(" ", "")
    if THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    fraction = FRAC.match(answer)
    if fraction:
        answer = f"{fraction[1]}{fraction[2]}/{fraction[3]}"
    if not bounded(answer):
        return None
    try:
        return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None
