"""lm-evaluation-harness task definitions that read the six zero-shot sets from local files (nothing is
downloaded): the harness's own prompts, choices and metrics for hellaswag, piqa, winogrande, arc_easy,
arc_challenge and openbookqa, with `dataset_path: json` over DIR/{task}.jsonl. Task names end in `_local`.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import os
import shutil

METRICS = """metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

PROMPTS = {  # lm-eval 0.4's default task definitions, dataset fields as Hugging Face ships them
    "piqa": 'doc_to_text: "Question: {{goal}}\\nAnswer:"\ndoc_to_target: label\ndoc_to_choice: "{{[sol1, sol2]}}"\n',
    "arc_easy": 'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{choices.label.index(answerKey)}}"\n'
    'doc_to_choice: "{{choices.text}}"\n',
    "arc_challenge": 'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
    'doc_to_target: "{{choices.label.index(answerKey)}}"\ndoc_to_choice: "{{choices.text}}"\n',
    "openbookqa": 'doc_to_text: question_stem\ndoc_to_target: "{{choices.label.index(answerKey.lstrip())}}"\n'
    'doc_to_choice: "{{choices.text}}"\n',
    "hellaswag": 'process_docs: !function resformer_local_tasks.hellaswag_process_docs\ndoc_to_text: "{{query}}"\n'
    'doc_to_target: "{{label}}"\ndoc_to_choice: "choices"\n',
    "winogrande": "doc_to_text: !function resformer_local_tasks.winogrande_doc_to_text\n"
    "doc_to_target: !function resformer_local_tasks.winogrande_doc_to_target\n"
    "doc_to_choice: !function resformer_local_tasks.winogrande_doc_to_choice\n",
}


def write_tasks(task_data: str, out: str, tasks=tuple(PROMPTS)) -> list[str]:
    """Writes one {task}_local.yaml per task (reading task_data/{task}.jsonl) and their helper module."""
    os.makedirs(out, exist_ok=True)
    written = []
    for task in tasks:
        data = os.path.join(task_data, f"{task}.jsonl")
        text = (
            f"task: {task}_local\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    validation: {data}\n"
            "output_type: multiple_choice\ntraining_split: null\nvalidation_split: validation\ntest_split: null\n"
            + PROMPTS[task]
            + (METRICS if task != "winogrande" else METRICS.split("  - metric: acc_norm")[0])
            + "metadata:\n  version: 1.0\n"
        )
        path = os.path.join(out, f"{task}_local.yaml")
        with open(path, "w") as f:
            f.write(text)
        written.append(path)
    # the helpers the YAMLs name (`!function resformer_local_tasks...`) must sit beside them
    shutil.copyfile(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_task_helpers.py"),
        os.path.join(out, "resformer_local_tasks.py"),
    )
    return written
