"""Monitoring the served policy: its traffic rows (``traffic``), their features (``prompt_features``,
``embeddings``) and drift against the training reference (``drift``)."""
