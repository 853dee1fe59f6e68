"""Prepared corpora exposed as tensorflow-datasets datasets (array_record format, no TensorFlow).

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import os
import re

import numpy as np

from resformer_jax.data.records import DataError, DomainSource, load_metadata

NAME = "resformer_corpus"


def _slug(domain: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", domain.lower())


def _builder_cls():
    import tensorflow_datasets as tfds

    class ResformerCorpus(tfds.core.GeneratorBasedBuilder):
        """Packed token sequences of one domain of a prepared corpus."""

        VERSION = tfds.core.Version("1.0.0")

        def __init__(self, *, corpus_path: str = "", meta: dict | None = None, domain: str = "", **kwargs):
            self.corpus_path, self.meta, self.domain = corpus_path, meta, domain
            super().__init__(**kwargs)

        def _info(self):
            L = self.meta["record_len"] if self.meta else None
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict({"tokens": tfds.features.Tensor(shape=(L,), dtype=np.int32)}),
                disable_shuffling=True,
            )  # keep record order: the pipeline shuffles by seed

        def _split_generators(self, dl_manager):
            return {
                split: self._generate_examples(split)
                for split in ("train", "validation")
                if self.meta["splits"].get(split, {}).get(self.domain, {}).get("sequences")
            }

        def _generate_examples(self, split):
            src = DomainSource(self.corpus_path, self.meta, split, self.domain)
            for i in range(len(src)):
                yield i, {"tokens": src[i]}

    ResformerCorpus.name = NAME
    return ResformerCorpus


def build(corpus_path: str) -> str:
    """Writes the tfds datasets (array_record files) for every domain; returns their data_dir."""
    import tensorflow_datasets as tfds

    meta = load_metadata(corpus_path)
    data_dir = os.path.join(corpus_path, "tfds")
    cls = _builder_cls()
    domains = sorted({d for sp in meta["splits"].values() for d in sp})
    for dom in domains:
        b = cls(
            corpus_path=corpus_path,
            meta=meta,
            domain=dom,
            data_dir=data_dir,
            config=tfds.core.BuilderConfig(name=_slug(dom)),
        )
        b.download_and_prepare(file_format="array_record")
    return data_dir


class TfdsDomainSource:
    """Random access over one domain's split through tfds.data_source."""

    def __init__(self, corpus_path: str, split: str, domain: str):
        import tensorflow_datasets as tfds

        data_dir = os.path.join(corpus_path, "tfds")
        try:
            self.src = tfds.data_source(
                f"{NAME}/{_slug(domain)}", split=split, data_dir=data_dir, download=False, builder_kwargs={}
            )
        except Exception as e:
            raise DataError(
                f"no tfds dataset for domain {domain!r} split {split!r} under {data_dir} ({type(e).__name__}); "
                f"build it with `resformer tfds-build --data={corpus_path}`"
            ) from None

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return np.asarray(self.src[int(i)]["tokens"], np.int32)


def tfds_domain_source(corpus_path: str, split: str, domain: str):
    return TfdsDomainSource(corpus_path, split, domain)
