"""How messages count things (``1 tensor``, ``2 tensors``), quote values read from files, and guess typos."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from itertools import islice


def closest(word: str, choices: Iterable[str]) -> str | None:
    """Return the one of ``choices`` ``word`` is most likely a typo of, or None when none is close."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def a_or_an(word: str) -> str:
    """Return ``word`` with the article it is read with: ``a DCP``, ``an accelerate``, ``an FSDP1``.

    By sound, roughly: a vowel letter, or an initialism whose first letter is named with a
    vowel sound (F, H, L, M, N, R, S, X: "an FSDP1", "an HF").
    """
    initialism = len(word) > 1 and word[:2].isupper()
    vowel = word[:1].lower() in "aeiou" or (initialism and word[0] in "AEFHILMNORSX")
    return f"{'an' if vowel else 'a'} {word}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """Return ``n`` and ``noun``, plural unless ``n`` is 1 (``plural`` for irregular nouns)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


class _Brief(reprlib.Repr):
    """``reprlib``'s bounded repr, which also bounds subclasses of the builtin containers.

    ``reprlib`` picks its method by type name, so an ``OrderedDict`` or a ``torch.Size``
    would get the full ``repr``, however large.
    """

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxdict = self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 4
        self.maxstring = self.maxother = 40

    # reprlib sorts a dict's keys and a set's items first: every item compared, for four shown.
    def repr_dict(self, x: dict, level: int) -> str:
        if not x or level <= 0:
            return "{...}" if x else "{}"
        pieces = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in islice(x.items(), self.maxdict)
        ]
        return "{" + ", ".join(pieces + ["..."] * (len(x) > self.maxdict)) + "}"

    def repr_set(self, x: set, level: int) -> str:
        return self._repr_iterable(x, level, "{", "}", self.maxset) if x else "set()"

    def repr_frozenset(self, x: frozenset, level: int) -> str:
        if not x:
            return "frozenset()"
        return self._repr_iterable(x, level, "frozenset({", "})", self.maxfrozenset)

    def repr_int(self, x: int, level: int) -> str:
        # Printing an int costs quadratic time in its digits, and Python refuses past 4300.
        return repr(x) if x.bit_length() <= 64 else f"<an int of {x.bit_length()} bits>"

    def repr1(self, x: object, level: int) -> str:
        for base in (dict, list, tuple, set, frozenset, str, int):
            if isinstance(x, base) and type(x) is not base:
                return getattr(self, f"repr_{base.__name__}")(x, level)
        return super().repr1(x, level)


_BRIEF = _Brief()


def shown(value: object, width: int = 60) -> str:
    """Return ``repr(value)`` in at most ``width`` characters, without building more of it.

    Every value a message quotes from a checkpoint goes through here: a file may hold a
    string of megabytes, or a list whose full ``repr`` would never end.
    """
    return clipped(_BRIEF.repr(value), width)


def clipped(text: str, width: int = 60) -> str:
    """Return ``text``, cut to ``width`` characters with ``...`` at the end if longer."""
    return text if len(text) <= width else text[: width - 3] + "..."
