"""Several configuration problems reported at once, one line each.

Apart from `validate.py` so that the YAML loader, which reports every repeated key
at once, needs nothing of the checks that load files through it.
"""

from __future__ import annotations

from gpuwatchd.errors import ConfigError

__all__ = ["ConfigErrors", "raise_all"]


class ConfigErrors(ConfigError):
    """Several configuration problems; `str()` gives one line per problem."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        first = errors[0]
        super().__init__(first.path, first.key, first.problem)

    def __str__(self) -> str:
        return "\n".join(ConfigError.__str__(e) for e in getattr(self, "errors", [self]))


def raise_all(errors: list[ConfigError]) -> None:
    """Raise the one error, or all of them together; nothing when the list is empty."""
    flat = [x for e in errors for x in (e.errors if isinstance(e, ConfigErrors) else [e])]
    if len(flat) == 1:
        raise flat[0]
    if flat:
        raise ConfigErrors(flat)
