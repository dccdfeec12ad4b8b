"""The policy as an MLflow pyfunc model (models from code: MLflow runs this file when it loads the model).

A GSM8k question in, its answer out: the core's prompt builder (``rlvr.prompts.render_prompt``),
greedy decoding (``rlvr.generation.generate_rollouts``) and answer extractor
(``rlvr.answers.extract_final_answer``, strict, as the service's ``/solve``): one implementation
everywhere, in the environment the checkpoint records (``rlvr.policy.policy_environment``). The
checkpoint is the model's ``checkpoint`` artifact (an HF folder).
"""

from __future__ import annotations

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

DEFAULT_MAX_NEW_TOKENS = 256


class GSM8kPolicy(PythonModel):
    """``predict``: a frame with a ``question`` column -> ``answer`` (the strict final answer, "" when
    none) and ``completion`` per row; param ``max_new_tokens``."""

    def load_context(self, context) -> None:
        from rlvr.policy import load_policy, policy_environment

        self.model, self.tokenizer = load_policy(context.artifacts["checkpoint"])
        self.environment = policy_environment(context.artifacts["checkpoint"])

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:  # a DataFrame hint: the logged signature governs
        from rlvr.answers import extract_final_answer
        from rlvr.generation import SamplingConfig, generate_rollouts
        from rlvr.prompts import render_prompt, system_prompt_for

        questions = list(pd.DataFrame(model_input)["question"].astype(str))
        max_new_tokens = int((params or {}).get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        prompts = [render_prompt(self.tokenizer, question, system_prompt_for(self.environment)) for question in questions]
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperatures=[0.0], environment=self.environment)
        rollouts = generate_rollouts(self.model, self.tokenizer, prompts, 1, sampling)
        answers = [extract_final_answer(text, "strict") for text in rollouts.texts]
        return pd.DataFrame({"answer": [a.text if a else "" for a in answers], "completion": rollouts.texts})


mlflow.models.set_model(GSM8kPolicy())
