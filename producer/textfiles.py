"""Reading the producer's input files (prompt lists, catalogs) as UTF-8 text, with errors that
name the file and the reason.

Place in the data flow: a user's file → **here** → prompts (:mod:`producer.prompts`) or catalog
items (:mod:`producer.catalog.items`) → render requests.
"""

from __future__ import annotations

from pathlib import Path


def read_text_file(path: str | Path, what: str, error: type[Exception]) -> str:
    """The text of ``path`` (UTF-8, a leading byte-order mark dropped).

    Args:
        what: how messages name the file, e.g. ``"prompt file"`` or ``"catalog"``.
        error: the exception class raised (the caller's own, a ``ValueError`` subclass).
    Raises:
        ``error``: the file does not exist, is a directory, is not UTF-8, or cannot be read.
    """
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a directory") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise error(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
