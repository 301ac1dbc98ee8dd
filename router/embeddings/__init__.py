"""``POST /v1/embeddings``: the body (:mod:`router.embeddings.protocol`) and the work from body to
response (:mod:`router.embeddings.service`); ``docs/embeddings.md``."""
