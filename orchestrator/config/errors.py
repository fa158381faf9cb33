"""ConfigError: the one exception a user's config, its YAML or its --set turns into, one line
naming the file and the dotted key (the CLI prints it and exits 2)."""

from __future__ import annotations

MAX_KEY_SHOWN = 120  # characters of a dotted key an error message shows


class ConfigError(ValueError):
    """A user error in a config: one line, naming the file and the dotted key."""

    def __init__(self, key: str, message: str, *, source: str | None = None):
        self.key = key
        self.message = message
        self.source = source
        super().__init__(self._render())

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.key, self.message, source=source)

    def _render(self) -> str:
        key = self.key if len(self.key) <= MAX_KEY_SHOWN else self.key[:MAX_KEY_SHOWN] + "..."
        where = f"{key}: " if key else ""
        src = f"{self.source}: " if self.source else ""
        return one_line(f"{src}{where}{self.message}")


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped: a key or a file name from a
    hostile config cannot break the one-line error into several."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def join_key(path: str, key: str | int) -> str:
    """`path.key`, the dotted key of `key` inside `path` ('' is the top)."""
    return f"{path}.{key}" if path else str(key)
