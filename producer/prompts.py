"""Prompt files for the producer: where the text of a batch comes from, before it becomes
:class:`~infra.schemas.RenderRequest` objects and enters the queue.

Two formats are read: a plain text file (one prompt per non-empty line) and a
PartiPrompts-style TSV (tab-separated, with a header row that has a ``Prompt`` column).
:data:`DEFAULT_PROMPTS` is a short built-in list for demos and smoke tests.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from producer.textfiles import read_text_file

__all__ = ["DEFAULT_PROMPTS", "PromptFileError", "load_prompts"]

#: Sixteen varied prompts for demos: subjects, styles, lighting and text rendering.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "a red fox sitting in fresh snow at dawn, soft golden light",
    "a lighthouse on a rocky cliff during a storm, oil painting",
    "a bowl of ramen with a soft-boiled egg, studio food photography",
    "an astronaut riding a bicycle on the moon, watercolor",
    "a cozy reading nook with a cat asleep on a pile of books",
    "a futuristic city skyline at night with neon reflections in the rain",
    "a close-up of a hummingbird drinking from a purple flower",
    "a medieval castle floating on a cloud, fantasy illustration",
    "a vintage red bicycle leaning against a blue door in Lisbon",
    "a snow-capped mountain reflected in a still alpine lake",
    "a robot watering plants in a greenhouse, isometric 3d render",
    "a steaming cup of coffee on a wooden table, morning light",
    "a paper origami crane on a white background, minimalist",
    'a chalkboard with the words "render farm" written in neat cursive',
    "a koi pond seen from above with lily pads, ukiyo-e style",
    "a desert road at sunset with a lone cactus, cinematic wide shot",
)


class PromptFileError(ValueError):
    """A prompt file could not be used; the message names the file and the reason."""


def load_prompts(path: str | Path) -> list[str]:
    """Read the prompts of ``path``, in file order, stripped of surrounding whitespace.

    A file is read as a TSV when its first line has tab-separated fields one of which is
    ``Prompt`` (any case), or when its name ends in ``.tsv``; the prompts are then that
    column's non-empty cells. Any other file is plain text: one prompt per non-empty line.

    Raises:
        PromptFileError: the file is missing, unreadable, not UTF-8, a ``.tsv`` without a
            ``Prompt`` column, or holds no prompt.
    """
    path = Path(path)
    text = read_text_file(path, "prompt file", PromptFileError)

    lines = text.splitlines()
    header = lines[0].split("\t") if lines else []
    prompt_column = next((i for i, name in enumerate(header) if name.strip().lower() == "prompt"), None)
    is_tsv = path.suffix.lower() == ".tsv"
    if prompt_column is not None and (len(header) > 1 or is_tsv):
        prompts = _tsv_column(text, prompt_column)
        kind = f"TSV column {header[prompt_column].strip()!r}"
    elif is_tsv:
        raise PromptFileError(f"prompt file {path} is a .tsv without a 'Prompt' column in its header")
    else:
        prompts = [line.strip() for line in lines if line.strip()]
        kind = "text lines"
    if not prompts:
        raise PromptFileError(f"prompt file {path} holds no prompts ({kind} are all empty)")
    return prompts


def _tsv_column(text: str, column: int) -> list[str]:
    """Non-empty cells of ``column`` below the header. Quotes are literal (PartiPrompts style)."""
    reader = csv.reader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE)
    next(reader, None)
    return [row[column].strip() for row in reader if len(row) > column and row[column].strip()]
