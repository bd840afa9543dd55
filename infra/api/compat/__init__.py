"""The compatible front doors of the status API: AUTOMATIC1111's web UI API (``/sdapi/v1``) and
OpenAI's Images API (``/v1/images/generations``, ``/v1/images/edits``), so that their clients
work against the farm unmodified.

Place in the data flow: an A1111 or OpenAI client → **a compatible route** (its body mapped onto
:class:`~infra.schemas.RenderRequest`: :mod:`~infra.api.compat.a1111_models`,
:mod:`~infra.api.compat.a1111_img2img`, :mod:`~infra.api.compat.openai_images`,
:mod:`~infra.api.compat.openai_edits`) → submission (:mod:`infra.submission`) → the farm →
:mod:`~infra.api.compat.sync` waits for the images over the queue and answers in the family's
own shape (its errors too: :mod:`infra.api.error_shapes`).
"""
