"""Text from users (arguments, stdin, JSON lines and files) checked to be text UTF-8 can encode, before any model
sees it: a ValueError says where it is not, so bad input is one clear error rather than a tokenizer's traceback.

Two things reach us as text that is not: a byte that is not UTF-8 in an argument or on stdin (Python keeps it
as a surrogate escape, U+DC80..U+DCFF) and a lone UTF-16 surrogate from a JSON escape such as "\\ud800".
"""

from __future__ import annotations


def checked_text(text: str, where: str) -> str:
    """`text` if UTF-8 can encode it; otherwise a ValueError naming `where` and the place of the first bad
    character (its line and column when `text` has several lines)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        if "\udc80" <= bad <= "\udcff":     # surrogateescape's stand-in for the byte ord(bad) - 0xdc00
            what = f"byte 0x{ord(bad) - 0xdc00:02x} is not UTF-8"
        else:
            what = f"a lone surrogate \\u{ord(bad):04x} (half of a UTF-16 pair) is not text"
        line, line_start = text.count("\n", 0, exc.start) + 1, text.rfind("\n", 0, exc.start) + 1
        place = f"line {line}, column {exc.start - line_start + 1}" if "\n" in text else f"character {exc.start + 1}"
        raise ValueError(f"{where}: {what} (at {place}); give UTF-8 text") from None
    return text


def check_json_text(value, where: str) -> None:
    """Every string in a parsed JSON value (keys included) through `checked_text`; the error names the path to
    the bad string below `where` (e.g. `messages[1].content`; `where` is "" for a whole JSON line)."""
    if isinstance(value, str):
        checked_text(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            checked_text(key, f"{where or 'the line'}: a key")
            check_json_text(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_text(item, f"{where}[{index}]")
