"""How a failure becomes the text of a row's `error` field."""
import re


def format_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def warning_hints(caught) -> str:
    """The reasons SDPA gives (as warnings) for refusing a backend, compacted."""
    hints = []
    for w in caught:
        text = re.sub(r"\s*\(Triggered internally at[^)]*\)\.?", "", " ".join(str(w.message).split())).strip()
        if not text or text.endswith("because:") or text in hints:
            continue
        if any(s in text for s in ("support", "require", "Expected", "expected", "must", "only")):
            hints.append(text[:110])
    return (" [" + " | ".join(hints[:2]) + "]") if hints else ""
