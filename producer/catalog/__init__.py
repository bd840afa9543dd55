"""``renderfarm catalog``: render a catalog file (CSV or JSON Lines) through the farm, idempotently.

Data flow: catalog file → **here**: one :class:`~infra.schemas.RenderRequest` per item (prompt
from ``--template``, parameters, a seed) and its content key → ``POST /v1/catalog/lookup``
(which keys already have an image, which have a job in flight) → ``POST /v1/batches`` in chunks,
for the rest only → workers → S3 → **here** again: batch polling, a progress bar, the report.

Content-addressed keys: an item's key is the SHA-256 of its model, prompt, negative prompt,
parameters (size, steps, guidance, scheduler, format) and seed. Its seed is the item's ``seed``
field, or else derived from that same content, so a re-run computes the same keys. Each job
carries its key as ``metadata["catalog_key"]``; the API indexes key → job per tenant
(:mod:`infra.state.catalog_index`), and that index, kept by the farm, is what makes runs idempotent
and resumable on a fresh machine (a CronJob pod has no local state):

* a key whose job succeeded, or whose image is in the bucket, is **skipped**;
* a key whose job is queued or running (an interrupted earlier run) is **waited for**, never
  submitted again;
* a key that is unknown, failed or canceled is **submitted**.

So an unchanged catalog renders nothing, a changed item renders only itself, and a run stopped
with Ctrl-C resumes where it stopped. Each chunk has an ``idempotency_key`` derived from its
keys, so retrying a request whose answer was lost returns the first batch. ``--state-dir`` adds
a local record of succeeded keys; a recorded key is still looked up, and skipped only when the
farm confirms its image (a HEAD), so a deleted image is rendered again.

An item's fields fill the template's ``{field}`` placeholders; fields named like parameters
(``seed``, ``width``, ``height``, ``steps``, ``guidance_scale``, ``negative_prompt``,
``scheduler``, ``output_format``, ``model``) also set them, over the command line's defaults.

Modules: :mod:`~producer.catalog.items` (reading), :mod:`~producer.catalog.templates`,
:mod:`~producer.catalog.plan` (requests and content keys), :mod:`~producer.catalog.run` (the loop
and the report), :mod:`~producer.catalog.chunks` (one chunk's uploads and submission),
:mod:`~producer.catalog.cli` (``renderfarm catalog``).
"""

from producer.catalog.cli import register, run_catalog
from producer.catalog.items import CatalogError, Item, read_catalog
from producer.catalog.plan import Plan, content_key, derive_seed, plan_item, plan_items, prepare_catalog
from producer.catalog.run import CatalogRun, StateDir
from producer.catalog.templates import Template

__all__ = ["CatalogError", "CatalogRun", "Item", "Plan", "StateDir", "Template", "content_key", "derive_seed",
           "plan_item", "plan_items", "prepare_catalog", "read_catalog", "register", "run_catalog"]
