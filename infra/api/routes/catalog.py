"""``POST /v1/catalog/lookup``: which catalog items already have an image, a job in flight, or
neither.

Place in the data flow: the catalog runner (:mod:`producer.catalog`) → **here** → the tenant's
catalog index (:mod:`infra.state.catalog_index`) and, for expired job records, the bucket.
"""

from __future__ import annotations

from fastapi import APIRouter

from infra.api.deps import FarmDep, Tenant
from infra.state.catalog_index import CatalogLookup, CatalogLookupResult

router = APIRouter(prefix="/v1/catalog", tags=["catalog"])


@router.post("/lookup", response_model=CatalogLookupResult)
def catalog_lookup(body: CatalogLookup, farm: FarmDep, tenant: Tenant) -> CatalogLookupResult:
    """Per catalog key (``metadata.catalog_key`` of a submitted job), this tenant's job for it
    and its state, or null when no image exists and no job renders it; an image's entry has its
    S3 key (``result_key``) and a presigned GET ``url``."""
    entries = farm.catalog.lookup(tenant, body.keys)
    for entry in entries.values():
        if entry is not None and entry.result_key:
            entry.url = farm.storage.presigned_url(entry.result_key)
    return CatalogLookupResult(entries=entries)
