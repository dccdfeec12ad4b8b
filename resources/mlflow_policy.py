"""A stored policy checkpoint as a logged MLflow model of a run: the pyfunc of ``policy_pyfunc.py``
with a signature and an input example, so ``mlflow.pyfunc.load_model("models:/<name>@champion")``
answers a question of the policy's tasks and ``mlflow models serve`` serves it."""

from __future__ import annotations

import tempfile
from importlib.metadata import version
from pathlib import Path

import pandas as pd

MODEL_NAME = "policy"  # the logged model's name in its run
CHECKPOINT_ARTIFACT = "checkpoint"  # the HF folder inside the model's artifacts
PYFUNC_CODE = Path(__file__).with_name("policy_pyfunc.py")
QUESTION_EXAMPLE = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"


def policy_signature():
    """``question`` (string) and an optional ``task`` in; ``answer`` and ``completion`` out; param ``max_new_tokens``."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    from resources.policy_pyfunc import DEFAULT_MAX_NEW_TOKENS

    return ModelSignature(
        inputs=Schema([ColSpec("string", "question"), ColSpec("string", "task", required=False)]),
        outputs=Schema([ColSpec("string", "answer"), ColSpec("string", "completion")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", DEFAULT_MAX_NEW_TOKENS)]),
    )


def requirements() -> list[str]:
    """The model's pip requirements, pinned to this environment (not inferred: that would load the model)."""
    return [f"{name}=={version(name)}" for name in ("mlflow", "torch", "transformers", "pandas", "rlvr-ops")]


def log_policy_model(client, experiment_id: str, run_id: str, checkpoint: str | Path, tags: dict[str, str] | None = None):
    """Log ``checkpoint`` as the run's ``policy`` model (a LoggedModel, an output of the run); returns it."""
    import mlflow.pyfunc
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    model = client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=run_id, tags=tags, model_type="gsm8k-policy")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "model"
            mlflow.pyfunc.save_model(
                str(local),
                python_model=str(PYFUNC_CODE),
                artifacts={CHECKPOINT_ARTIFACT: str(checkpoint)},
                signature=policy_signature(),
                input_example=pd.DataFrame({"question": [QUESTION_EXAMPLE]}),
                pip_requirements=requirements(),
                mlflow_model=Model(artifact_path=model.artifact_location, model_uuid=model.model_id, run_id=run_id, model_id=model.model_id),
            )
            client.log_model_artifacts(model.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    return client.finalize_logged_model(model.model_id, "READY")


def checkpoint_in(downloaded: str | Path) -> Path:
    """The HF checkpoint inside a downloaded artifact: a logged policy model's ``checkpoint`` artifact
    (where its MLmodel says), or the folder itself (versions registered from a run's ``checkpoint`` folder)."""
    from mlflow.models import Model

    folder = Path(downloaded)
    if not (folder / "MLmodel").is_file():
        return folder
    artifacts = Model.load(str(folder / "MLmodel")).flavors.get("python_function", {}).get("artifacts", {})
    return folder / artifacts[CHECKPOINT_ARTIFACT]["path"] if CHECKPOINT_ARTIFACT in artifacts else folder
