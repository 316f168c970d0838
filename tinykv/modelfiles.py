"""The JSON files of a Hugging Face-style model folder (config.json, tokenizer_config.json,
generation_config.json), read field by field with each field's type checked: a value of the wrong
type is a one-line ModelFileError naming the file and the field, never a KeyError or a TypeError
from deep inside the loader. JSON null counts as absent, as transformers reads it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

_ABSENT = object()


class ModelFileError(ValueError):
    """A model folder's JSON file that is missing, malformed or holds a field of the wrong type;
    the message is one line naming the file and the field."""


class Fields:
    """One JSON object of a model folder: `name` (the file, or file and section) and its fields.
    Each reader returns the field's value, or `default` when it is absent or null, and raises
    ModelFileError when it is there but not of the type asked for."""

    def __init__(self, name: str, data: dict[str, Any]):
        self.name, self.data = name, data

    @classmethod
    def load(cls, path: str | Path, required: bool = False) -> Fields:
        """The file's fields; an absent optional file has none."""
        path = Path(path)
        if not path.is_file():
            if required:
                raise ModelFileError(f"no {path.name} in {path.parent}")
            return cls(str(path), {})
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            first = str(e).splitlines()[0]
            raise ModelFileError(f"{path} is not valid JSON: {first}") from None
        if not isinstance(data, dict):
            raise ModelFileError(f"{path} is not a JSON object (it holds a "
                                 f"{type(data).__name__})")
        return cls(str(path), data)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None and default is _ABSENT:
            raise ModelFileError(f"{self.name}: field {key!r} is missing")
        return value

    def _bad(self, key: str, value: Any, want: str) -> ModelFileError:
        shown = json.dumps(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return ModelFileError(f"{self.name}: field {key!r} is {shown}, expected {want}")

    def int(self, key: str, default: Any = _ABSENT, lo: int | None = None) -> Any:
        """An integer (not a bool), at least lo when lo is given."""
        value = self._get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
            want = "an integer" if lo is None else f"an integer >= {lo}"
            raise self._bad(key, value, want)
        return value

    def float(self, key: str, default: Any = _ABSENT, positive: bool = False) -> Any:
        """A finite number (an integer is taken as a float), > 0 with positive."""
        value = self._get(key, default)
        if value is None:
            return default
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (value > 0 or not positive)
        if not ok:
            raise self._bad(key, value, "a positive number" if positive else "a number")
        return float(value)

    def bool(self, key: str, default: Any = _ABSENT) -> Any:
        value = self._get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def str(self, key: str, default: Any = _ABSENT) -> Any:
        value = self._get(key, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._bad(key, value, "a string")
        return value

    def ids(self, key: str) -> list[int]:
        """Token ids: absent, one id, or a list of ids (each >= 0) -> a list."""
        value = self.data.get(key)
        if value is None:
            return []
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self._bad(key, value, "a token id or a list of token ids")
        return list(values)

    def token(self, key: str) -> str | None:
        """A special token's text: a string, or an AddedToken-style {"content": "..."}."""
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            return value["content"]
        raise self._bad(key, value, 'a token: a string or {"content": "..."}')

    def section(self, key: str) -> Fields | None:
        """A nested object (e.g. config.json's rope_scaling) as Fields of its own."""
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._bad(key, value, "an object")
        return Fields(f"{self.name}: {key}", value)

    def llama3_scaling(self) -> dict[str, float]:
        """This rope_scaling section's four llama3 numbers, checked (RoPE divides by the gap
        between the two frequency factors)."""
        low = self.float("low_freq_factor", 1.0, positive=True)
        high = self.float("high_freq_factor", 4.0, positive=True)
        if high <= low:
            raise ModelFileError(f"{self.name}: high_freq_factor {high} must exceed "
                                 f"low_freq_factor {low}")
        return {"factor": self.float("factor", positive=True), "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings":
                self.int("original_max_position_embeddings", lo=1)}

    def chat_template(self, key: str = "chat_template") -> str | None:
        """A Jinja template: a string, or a list of {"name", "template"} whose "default" one is
        used (None when none is named so)."""
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        named = isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value)
        if not named:
            raise self._bad(key, value, 'a template: a string or a list of {"name": ..., '
                                        '"template": ...}')
        return next((t["template"] for t in value if t["name"] == "default"), None)
