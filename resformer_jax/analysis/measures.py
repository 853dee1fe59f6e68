"""The paper's analysis measures as plain numpy functions (Eqs. 11-13)."""

from __future__ import annotations

import numpy as np


def token_importance_entropy(A_TxT: np.ndarray) -> float:
    """Eq. 11: entropy of token importance from a (head-averaged) causal attention matrix.

    Token j's importance a_j = (1/l) sum_i A_ij is the attention it receives,
    averaged over queries; a' = a / sum(a); e = -sum a'_j log a'_j.
    """
    a = A_TxT.astype(np.float64).mean(axis=0)
    a = a / a.sum()
    nz = a[a > 0]
    return float(-(nz * np.log(nz)).sum())


def mean_token_similarity(h_TxE: np.ndarray) -> float:
    """Eq. 13: mean pairwise cosine similarity of hidden states, i != j."""
    h = h_TxE.astype(np.float64)
    u = h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-12)
    l = len(u)
    s = u.sum(axis=0)
    return float((s @ s - (u * u).sum()) / (l * (l - 1)))


def value_spectrum(v_TxF: np.ndarray) -> np.ndarray:
    """Eq. 12: eigenvalues (descending) of the values' second-moment matrix (1/l) sum v_i v_i^T."""
    v = v_TxF.astype(np.float64)
    m = v.T @ v / len(v)
    return np.linalg.eigvalsh(m)[::-1]


def mean_spectrum(values: list[np.ndarray]) -> np.ndarray:
    """Eq. 12 as the paper aggregates it (Sec. 4.5): each example's sorted eigenvalues (value_spectrum of its
    [T, F] values), averaged over examples; not one eigendecomposition of values pooled over all examples."""
    return np.mean([value_spectrum(v) for v in values], axis=0)


def first_token_share(A_TxT: np.ndarray) -> float:
    """Mean attention weight on the first token (attention sinks)."""
    return float(A_TxT[:, 0].mean())


def uniform_causal_entropy(l: int) -> float:
    """Closed form of Eq. 11 for uniform causal attention (A_ij = 1/(i+1), j <= i)."""
    inv = 1.0 / np.arange(1, l + 1)
    a = np.cumsum(inv[::-1])[::-1] / l  # a_j = (1/l) sum_{i >= j} 1/(i+1)
    a = a / a.sum()
    return float(-(a * np.log(a)).sum())


def moving_average(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (window w; the first points average what exists)."""
    y = np.asarray(y, np.float64)
    if window <= 1:
        return y
    c = np.cumsum(np.concatenate([[0.0], y]))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def _softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def _mean_cosine(a_TxF: np.ndarray, b_TxF: np.ndarray) -> float:
    num = (a_TxF * b_TxF).sum(-1)
    den = np.linalg.norm(a_TxF, axis=-1) * np.linalg.norm(b_TxF, axis=-1)
    return float((num / np.maximum(den, 1e-12)).mean())


def mapping_similarity(q_TxHxD, k_TxKxD, v_TxKxD, km_TxKxD, vm_TxKxD) -> dict[str, float]:
    """Fig. 3: how well cheaper mappings approximate the exact cross-layer attention of layer n over layer m.

    Eq. 2: softmax(Q_n [K_n; K_m]^T / sqrt d) [V_n; V_m] (causal in both halves); Eq. 3 (= Eq. 4): the same
    with K_m replaced by K_n, i.e. 1/2 A_n (V_n + V_m); Eq. 6: A_n V_n + V_m (the identity mapping of the
    earlier value). Returns the mean over tokens of the cosine similarity of each with Eq. 2's output (heads
    concatenated). q and k are the rotated (RoPE) ones the layer attends with.
    """
    T, H, D = q_TxHxD.shape
    G = H // k_TxKxD.shape[1]
    rep = lambda x: np.repeat(x.astype(np.float64), G, axis=1)
    q, k, v, km, vm = q_TxHxD.astype(np.float64), rep(k_TxKxD), rep(v_TxKxD), rep(km_TxKxD), rep(vm_TxKxD)
    causal = np.tril(np.ones((T, T), bool))[None]
    s_n = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(D), -np.inf)
    s_m = np.where(causal, np.einsum("thd,shd->hts", q, km) / np.sqrt(D), -np.inf)
    p = _softmax(np.concatenate([s_n, s_m], axis=-1))  # Eq. 2
    u2 = np.einsum("hts,shd->thd", p[..., :T], v) + np.einsum("hts,shd->thd", p[..., T:], vm)
    a_n = _softmax(s_n)
    u3 = 0.5 * np.einsum("hts,shd->thd", a_n, v + vm)  # Eq. 3 / Eq. 4
    u6 = np.einsum("hts,shd->thd", a_n, v) + vm  # Eq. 6 with the one earlier layer m
    flat = lambda u: u.reshape(T, -1)
    return {"eq3": _mean_cosine(flat(u3), flat(u2)), "eq6": _mean_cosine(flat(u6), flat(u2))}
