"""The BentoML stores (``$BENTOML_HOME``): the served policy packed into a Bento, offline, by ``bentos/build.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from dagster import ConfigurableResource
from pydantic import Field

from bentos.build import BuiltBento, bentoml_home, build_bento, store_policy


class BentoBuilder(ConfigurableResource):
    """Stores a checkpoint as the ``rlvr_policy`` model and builds the service's Bento around it."""

    home: Optional[str] = Field(default=None, description="BentoML home; default $BENTOML_HOME, else $RLVR_HOME/bentoml")

    def home_path(self) -> Path:
        return bentoml_home(self.home)

    def built_for(self, model_version: str) -> str | None:
        """Tag of a Bento in the store already built around ``model_version`` (its ``model_version`` label), or None."""
        from bentoml._internal.bento import BentoStore  # an explicit store: the global one is fixed at first use
        from bentoml.exceptions import NotFound

        from bentos import MODEL_NAME

        folder = self.home_path() / "bentos"
        if not (folder / MODEL_NAME).is_dir():
            return None
        try:
            bentos = BentoStore(str(folder)).list(MODEL_NAME)
        except NotFound:
            return None
        found = [b for b in bentos if b.info.labels.get("model_version") == model_version]
        return str(max(found, key=lambda b: b.creation_time).tag) if found else None

    def store_model(self, checkpoint: Path, labels: Mapping[str, str], metadata: Mapping | None = None) -> str:
        """Copy a checkpoint into the BentoML model store as ``rlvr_policy`` (lineage as ``labels``); its tag."""
        return store_policy(checkpoint, labels, metadata=metadata, home=self.home_path())

    def build(self, model_tag: str, labels: Mapping[str, str]) -> BuiltBento:
        """Build the service's Bento around a stored model, offline."""
        return build_bento(model_tag, labels=labels, home=self.home_path())

    def containerize_command(self, tag: str) -> str:
        return f"BENTOML_HOME={self.home_path()} bentoml containerize {tag}"
