"""The BentoML service of the trained policy.

``service`` holds the ``RlvrPolicy`` service (``/generate``, ``/solve``, the OpenAI-compatible ``/v1``
endpoints, probes, metrics, traffic logs); ``limits`` every bound it enforces; ``native_models``,
``openai_models`` and ``tokenizer_models`` its request/response models; ``openapi`` the document built from
its routes; ``serving_engine`` its side of the generation engine; ``openai_api`` OpenAI's wire format
(errors, choices, streamed chunks); ``build`` the functions the Dagster ``bento`` asset calls to store a
checkpoint and build a Bento.
Imports only the core library ``rlvr`` (never Dagster, DuckDB or MLflow).
"""

MODEL_NAME = "rlvr_policy"  # the policy's name in the BentoML model store (and the Bento's name)
SERVICE_NAME = MODEL_NAME  # the BentoML service's name (its config: services.rlvr_policy)
MODEL_VERSION_LABEL = "model_version"  # the model label each traffic record carries (else the tag's version)
