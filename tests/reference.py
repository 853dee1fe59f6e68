"""An independent plain-jnp forward of the paper's equations, from unrolled params.

Written from the paper, not from the Flax code: it repeats K/V heads
explicitly for GQA and builds the causal softmax by hand.
"""
import jax
import jax.numpy as jnp
import numpy as np


def rmsnorm(x, scale, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def rope(x, theta=10000.0):
    T, D = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None]
    sin, cos = np.sin(ang)[None, :, None], np.cos(ang)[None, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attend(q, k, v):
    H, K = q.shape[2], k.shape[2]
    k = jnp.repeat(k, H // K, axis=2)
    v = jnp.repeat(v, H // K, axis=2)
    T, D = q.shape[1], q.shape[-1]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    s = jnp.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def forward(p, tokens, mode, num_layers, l1=0.5, l2=0.5, neutreno_lam=None, stop_v1=False):
    """mode: none | resformer | svformer | neutreno | resformer+neutreno."""
    h = p["embed"]["embedding"][tokens]
    V1 = None
    for n in range(1, num_layers + 1):
        lp = p[f"layer_{n}"]
        a = lp["attn"]
        x = rmsnorm(h, lp["attn_norm"]["scale"])
        q = jnp.einsum("bte,ehd->bthd", x, a["query"]["kernel"])
        k = jnp.einsum("bte,ehd->bthd", x, a["key"]["kernel"])
        v = jnp.einsum("bte,ehd->bthd", x, a["value"]["kernel"]) if "value" in a else None
        if n == 1:
            V1 = v
            v_att = v
        else:
            V1n = jax.lax.stop_gradient(V1) if stop_v1 else V1
            if mode in ("resformer", "resformer+neutreno"):
                v_att = l1 * V1n + l2 * v  # Eq. 7
            elif mode == "svformer":
                v_att = V1n  # Eq. 10
            else:
                v_att = v
        u = attend(rope(q), rope(k), v_att)
        if n > 1 and mode in ("neutreno", "resformer+neutreno"):
            lam = neutreno_lam if neutreno_lam is not None else (0.2 if mode == "resformer+neutreno" else 0.4)
            H = q.shape[2]
            u = u + lam * jnp.repeat(V1n - v_att, H // v_att.shape[2], axis=2)  # Eq. 8
        h = h + jnp.einsum("bthd,hde->bte", u, a["out"]["kernel"])
        y = rmsnorm(h, lp["mlp_norm"]["scale"])
        mlp = lp["mlp"]
        g = y @ mlp["gate"]["kernel"]
        h = h + (jax.nn.silu(g) * (y @ mlp["up"]["kernel"])) @ mlp["down"]["kernel"]
    h = rmsnorm(h, p["final_norm"]["scale"])
    return h @ p["lm_head"]["kernel"]


def unstack_scanned(params, num_layers):
    """Scanned params ({'layers': {'block': stacked}}) -> unrolled ({'layer_n': ...})."""
    out = {k: v for k, v in params.items() if k != "layers"}
    stacked = params["layers"]["block"]
    for i in range(num_layers - 1):
        out[f"layer_{i + 2}"] = jax.tree.map(lambda x: x[i], stacked)
    return out


def stack_unrolled(params, num_layers):
    out = {k: v for k, v in params.items() if not k.startswith("layer_") or k == "layer_1"}
    blocks = [params[f"layer_{n}"] for n in range(2, num_layers + 1)]
    out["layers"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}
    return out
