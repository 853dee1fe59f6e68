"""Helpers of lm-eval 0.4's hellaswag and winogrande tasks (the same functions), for the local task files."""

import re


def _preprocess(text):
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_process_docs(dataset):
    def one(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [_preprocess(e) for e in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(one)


def winogrande_doc_to_text(doc):
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_doc_to_target(doc):
    return doc["sentence"][doc["sentence"].index("_") + 1 :].strip()


def winogrande_doc_to_choice(doc):
    i = doc["sentence"].index("_")
    return [doc["sentence"][:i] + o for o in (doc["option1"], doc["option2"])]
