"""The paper's definitions, exactly (issue 18): Eq. 12 averaged per example, Eq. 5 and the Fig. 7 pair."""
import importlib.util
import os

import numpy as np

from resformer_jax.analysis.measures import mean_spectrum, value_spectrum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ablation(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", "ablations", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ABLATION


def test_value_spectrum_is_averaged_per_example_not_pooled():
    """Two examples whose values lie along different directions: each has one eigenvalue (a^2, b^2), so the
    paper's per-example average is [(a^2 + b^2)/2, 0]; pooling the tokens first would give [a^2/2, b^2/2]."""
    T, a, b = 16, 3.0, 1.0
    v1 = np.zeros((T, 2))
    v1[:, 0] = a
    v2 = np.zeros((T, 2))
    v2[:, 1] = b
    np.testing.assert_allclose(mean_spectrum([v1, v2]), [(a * a + b * b) / 2, 0.0], atol=1e-12)
    pooled = value_spectrum(np.concatenate([v1, v2]))
    np.testing.assert_allclose(pooled, [a * a / 2, b * b / 2], atol=1e-12)
    assert not np.allclose(mean_spectrum([v1, v2]), pooled)


def test_fig7_configs_differ_only_in_the_mapping_and_eq5_eq6_have_their_own():
    ident, cross = ablation("mapping_identity"), ablation("mapping_cross_layer")
    assert {k: v for k, v in ident.items() if k != "mapping"} == {k: v for k, v in cross.items() if k != "mapping"}
    assert (ident["mapping"], cross["mapping"]) == ("identity", "cross_layer")
    assert ablation("mapping_identity_mean")["value_source"] == "mean_of_previous"  # Eq. 6 as written
    assert ablation("value_source_mean")["value_source"] == "mean_of_previous"  # Eq. 5 (tests/reference.py: a sum)
    assert ablation("value_source_mean_mixed")["value_source"] == "mean_of_previous_mixed"
