"""Webhooks on batch completion, the status API's room for them: delivery, signing and the
tenant's secret route.

Place in the data flow: submission enrolls a batch that names a ``webhook_url``
(:func:`infra.submission.submitter.enroll_webhook`, after checking the URL against the SSRF
policy, :mod:`infra.submission.url_policy`) → :mod:`~infra.api.webhooks.delivery`, a background
loop of every API process, POSTs once the batch ends → signed with the tenant's secret
(:mod:`~infra.api.webhooks.signing`), which the tenant reads and rotates through
``/v1/webhooks/secret`` (:mod:`~infra.api.webhooks.routes`).
"""
