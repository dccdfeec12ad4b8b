"""The policy as an MLflow pyfunc model (models from code: MLflow runs this file when it loads the model).

A question in, its answer out, in one of the tasks the checkpoint records (``rlvr.policy.policy_tasks``;
a ``task`` column picks one, default its first): the task's prompt (``Task.render_prompt``), greedy
decoding (``rlvr.generation.generate_rollouts``) stopped by the task's rule, and the task's parser
(``Task.parse``), as the service's ``/solve``: one implementation everywhere, in the environment the
checkpoint records (``rlvr.policy.policy_environment``). The checkpoint is the model's ``checkpoint``
artifact (an HF folder).
"""

from __future__ import annotations

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

DEFAULT_MAX_NEW_TOKENS = 256


class TaskPolicy(PythonModel):
    """``predict``: a frame with a ``question`` column (and optionally ``task``) -> ``answer`` (the task's
    parsed answer, "" when none) and ``completion`` per row; param ``max_new_tokens``."""

    def load_context(self, context) -> None:
        from rlvr.policy import load_policy, policy_environment, policy_tasks
        from rlvr.tasks import DEFAULT_TASK, get_task

        checkpoint = context.artifacts["checkpoint"]
        self.model, self.tokenizer = load_policy(checkpoint)
        self.environment = policy_environment(checkpoint)
        self.tasks = {name: get_task(name) for name in policy_tasks(checkpoint) or {DEFAULT_TASK: 1.0}}

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:  # a DataFrame hint: the logged signature governs
        from rlvr.generation import SamplingConfig, generate_rollouts

        frame = pd.DataFrame(model_input)
        if len(frame) and not isinstance(frame["question"].iloc[0], str):  # MLflow reads {"question": [...]} as one row of lists
            frame = frame.explode(list(frame.columns), ignore_index=True)
        questions = list(frame["question"].astype(str))
        names = [name if isinstance(name, str) and name else next(iter(self.tasks)) for name in frame.get("task", [None] * len(frame))]
        unknown = sorted(set(names) - set(self.tasks))
        if unknown:
            raise ValueError(f"task(s) {unknown} are not among the policy's tasks: {', '.join(self.tasks)}")
        tasks = [self.tasks[name] for name in names]
        max_new_tokens = int((params or {}).get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        prompts = [task.render_prompt(self.tokenizer, {"question": question}, self.environment) for task, question in zip(tasks, questions)]
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperatures=[0.0], environment=self.environment)
        rollouts = generate_rollouts(self.model, self.tokenizer, prompts, 1, sampling, [task.stop_rule for task in tasks])
        answers = [task.parse(text) for task, text in zip(tasks, rollouts.texts)]
        return pd.DataFrame({"answer": [answer or "" for answer in answers], "completion": rollouts.texts})


mlflow.models.set_model(TaskPolicy())
