"""Limits and word lists that the answer extractors share: extract.py (boxes, phrases, bare answers) and prose.py
(answers stated in a final sentence) both read them, so they live below both."""
from __future__ import annotations

import re

BARE_MAX_CHARS = 120       # longest completion read as a bare answer (no box, no phrase)

# Words that are no prose: units after a number, and function names of math.
UNIT_WORDS = (
    "cm|mm|km|m|meters?|metres?|centimeters?|millimeters?|kilometers?|inch|inches|in|feet|foot|ft|"
    "yards?|yd|miles?|mi|units?|square units|sq units|degrees?|deg|radians?|rad|cents?|dollars?|"
    "hours?|hrs?|h|minutes?|mins?|seconds?|secs?|s|days?|weeks?|months?|years?|kg|g|grams?|"
    "kilograms?|pounds?|lbs?|oz|ounces?|liters?|litres?|l|ml|gallons?|mph|km/h|m/s|"
    "people|students|apples|times|ways|points|marbles|books|pages|cookies|pieces"
)

# Words right after a box that deny it: "\boxed{C} is wrong", "(C), no, that is not it"
_DENIAL_RE = re.compile(
    r"(?i)^[\s$.,;:)\]}]*(?:(?:which|that|this|it)\s+)?(?:is|was|would\s+be|seems)\s+(?:not|wrong|incorrect|false)\b|"
    r"^[\s$.,;:)\]}]*(?:no|nope|wait)\b[\s,.!]+(?:that|this|it)\s*(?:is|'s)\s+(?:not|wrong|incorrect)")


def denied(after: str) -> bool:
    """True when the words that follow an answer deny it (a hack: name the option, then take it back)."""
    return _DENIAL_RE.match(after[:80]) is not None
