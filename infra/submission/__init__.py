"""Submission, below the HTTP layer: validated requests → checked inputs → a pool each → quotas →
job records (``queued``) → wait lanes; with the SSRF policy for the URLs a submission names.

Place in the data flow: producers → the status API (:mod:`infra.api`, which maps the domain
errors raised here to HTTP status codes) or any Python caller → **here** → the job-state store
(:mod:`infra.state`) and the wait lanes (:mod:`infra.broker.lanes`). Nothing here imports
FastAPI or Starlette: :class:`~infra.submission.submitter.Submitter` runs in the API process,
and as well in a test or a catalog runner with only Redis and S3.

Modules: :mod:`~infra.submission.submitter` (:class:`~infra.submission.submitter.Submitter`,
ids, idempotency, webhook enrolment), :mod:`~infra.submission.input_refs` (input images by key
or https URL → checked keys) and :mod:`~infra.submission.url_policy` (which addresses a webhook
or an input URL may reach).
"""
