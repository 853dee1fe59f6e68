"""An independent plain-jnp forward of the paper's equations, from unrolled params.

Written from the paper, not from the Flax code: it repeats K/V heads
explicitly for GQA and builds the causal softmax by hand.
"""

import functools

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
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
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


def attend_masked(q, k, v, mask):
    H, K = q.shape[2], k.shape[2]
    k = jnp.repeat(k, H // K, axis=2)
    v = jnp.repeat(v, H // K, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(mask, s, -np.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def forward_general(p, tokens, m):
    """Every ablation, written from the paper's equations over unrolled params."""
    L = m.num_layers
    resformer = m.value_residual in ("resformer", "resformer+neutreno")
    h = p["embed"]["embedding"][tokens]
    outs = [h]
    Q1 = K1 = V1 = None
    raw_values = []  # V_1 .. V_{n-1} (layers that own values)
    k_prev = v_prev = None
    v_shared = None
    l1s = np.zeros(L + 1)
    if m.resformer_lambdas == "learnable_plus":
        l1s = np.concatenate([[0, 0], np.asarray(p["lambda_scale"] * jax.nn.softmax(p["lambda_logits"]))])
    for n in range(1, L + 1):
        lp = p[f"layer_{n}"]
        a = lp["attn"]
        x = rmsnorm(h, lp["attn_norm"]["scale"])
        proj = lambda name: jnp.einsum("bte,ehd->bthd", x, a[name]["kernel"])
        cla_reuse = m.cla_share_every > 1 and (n - 1) % m.cla_share_every != 0
        q = proj("query") if "query" in a else Q1
        k = proj("key") if "key" in a else (k_prev if cla_reuse else K1)
        v = proj("value") if "value" in a else (v_prev if cla_reuse else None)
        N = m.value_embeddings  # U-Net pairs: layers i and L+1-i share table i - 1
        table = n - 1 if n <= N else (L - n if n > L - N else -1)
        if table >= 0:  # modded-nanogpt's value embeddings: a V_n + b VE[token], or V_n + 2 sigmoid(x W) VE
            ve = p[f"value_embed_{table}"]["embedding"][tokens].reshape(v.shape)
            if m.value_embedding_gate:
                v = v + 2 * jax.nn.sigmoid(jnp.einsum("bte,ek->btk", x, a["ve_gate"]["kernel"]))[..., None] * ve
            else:
                v = lp["attn"]["ve_lambdas"][0] * v + lp["attn"]["ve_lambdas"][1] * ve
        if n == 1:
            Q1, K1, V1 = q, k, v
            v_att = v
        else:
            if m.resformer_lambdas == "learnable":
                l1, l2 = lp["lambda1"], lp["lambda2"]
            elif m.resformer_lambdas == "learnable_plus":
                l1, l2 = l1s[n], lp["lambda2"]
            elif m.resformer_lambdas == "sparse":
                l1, l2 = (m.sparse_lambda if n in tuple(m.sparse_layers) else 0.0), 1.0
            elif m.resformer_lambdas == "convex":  # modded-nanogpt, 2024-11-06: (1 - l) V_n + l V_1
                l1 = lp["lambda"]
                l2 = 1.0 - l1
            else:
                l1, l2 = m.lambda_init
            uses_mean = m.value_source.startswith("mean") or m.mapping == "identity"
            mean = sum(raw_values) / len(raw_values) if raw_values and uses_mean else None
            src = {
                "first": V1,
                "previous": raw_values[-1] if raw_values else None,
                "mean_of_previous": mean,
                "mean_of_previous_mixed": mean,
            }[m.value_source]
            v_att = v
            if resformer and m.residual_on == "q":
                q = l1 * Q1 + l2 * q
            elif resformer and m.residual_on == "k":
                k = l1 * K1 + l2 * k
            elif resformer and m.mapping == "attention" and m.value_source == "mean_of_previous":
                v_att = (sum(raw_values) + v) / (len(raw_values) + 1)  # Eq. 5: (1/n) sum_{i<=n} V_i, a direct sum
            elif resformer and m.mapping == "attention" and m.resformer_lambdas == "gated":
                # x-transformers' learned mix: lerp(V_n, V_1, g), g = sigmoid(x W_g) per value head and token
                g = jax.nn.sigmoid(jnp.einsum("bte,ek->btk", x, a["value_gate"]["kernel"]))[..., None]
                v_att = (1 - g) * v + g * src
            elif resformer and m.mapping == "attention":
                v_att = l1 * src + l2 * v  # Eq. 7
            if m.value_residual == "skipv1":
                # SkipV1Former (arXiv 2510.16807): heads 1..K-r the layer's own, heads K-r+1..K layer 1's
                own = 0 if v is None else v.shape[2]
                v_att = V1 if v is None else jnp.concatenate([v, V1[:, :, own:]], axis=2)
            if m.value_residual == "svformer" and m.svformer_share == "v":
                if n in tuple(m.svformer_anchors):
                    v_shared = v  # Fig. 14: the anchor recomputes the shared value
                else:
                    v_att = v_shared if v_shared is not None else V1  # Eq. 10
        T = tokens.shape[1]
        causal = np.tril(np.ones((T, T), bool))
        if n > 1 and m.mapping == "cross_layer":
            mask = np.concatenate([causal, causal], 1)
            u = attend_masked(rope(q), jnp.concatenate([rope(k), rope(K1)], 1), jnp.concatenate([v, V1], 1), mask)
        else:
            u = attend(rope(q), rope(k), v_att)
        H = q.shape[2]
        if n > 1 and m.mapping == "identity":
            u = u + jnp.repeat(src, H // src.shape[2], axis=2)  # Eq. 6
        if n > 1 and m.value_residual in ("neutreno", "resformer+neutreno"):
            lam = 0.2 if m.value_residual == "resformer+neutreno" else 0.4
            u = u + lam * jnp.repeat(V1 - v_att, H // v_att.shape[2], axis=2)
        h = h + jnp.einsum("bthd,hde->bte", u, a["out"]["kernel"])
        y = rmsnorm(h, lp["mlp_norm"]["scale"])
        mlp = lp["mlp"]
        h = h + (jax.nn.silu(y @ mlp["gate"]["kernel"]) * (y @ mlp["up"]["kernel"])) @ mlp["down"]["kernel"]
        if m.denseformer:
            outs.append(h)
            alpha = p[f"dwa_{n}"]["alpha"]
            h = sum(alpha[i] * o for i, o in enumerate(outs))
        if "value" in a:
            raw_values.append(v)
        k_prev, v_prev = k, v
    h = rmsnorm(h, p["final_norm"]["scale"])
    return h @ p["lm_head"]["kernel"]


def layernorm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * scale + bias


def gelu_tanh(x):
    return 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def forward_gpt2(p, tokens, mode, num_layers, l1=0.5, l2=0.5):
    """GPT-2 (Radford et al. 2019) with the value residual: LayerNorm, GELU (tanh) MLP, learned absolute
    positions, biases, logits off the tied input embedding (or an lm_head where the params hold one, untied as
    paper Table 4); no RoPE. Written from GPT-2's definition."""
    T = tokens.shape[1]
    h = p["embed"]["embedding"][tokens] + p["pos_embed"][:T][None]
    V1 = None
    for n in range(1, num_layers + 1):
        lp = p[f"layer_{n}"]
        a = lp["attn"]
        x = layernorm(h, lp["attn_norm"]["scale"], lp["attn_norm"]["bias"])
        proj = lambda name: jnp.einsum("bte,ehd->bthd", x, a[name]["kernel"]) + a[name]["bias"]
        q, k = proj("query"), proj("key")
        v = proj("value") if "value" in a else None
        if n == 1:
            V1 = v
            va = v
        elif mode == "resformer":
            va = l1 * V1 + l2 * v  # Eq. 7
        elif mode == "svformer":
            va = V1  # Eq. 10
        else:
            va = v
        u = attend(q, k, va)
        h = h + jnp.einsum("bthd,hde->bte", u, a["out"]["kernel"]) + a["out"]["bias"]
        y = layernorm(h, lp["mlp_norm"]["scale"], lp["mlp_norm"]["bias"])
        mlp = lp["mlp"]
        h = h + gelu_tanh(y @ mlp["up"]["kernel"] + mlp["up"]["bias"]) @ mlp["down"]["kernel"] + mlp["down"]["bias"]
    h = layernorm(h, p["final_norm"]["scale"], p["final_norm"]["bias"])
    return h @ (p["lm_head"]["kernel"] if "lm_head" in p else p["embed"]["embedding"].T)


def llama3_inv_freq_numpy(inv_freq, rs):
    """Llama 3.1's RoPE frequency scaling, transcribed from Hugging Face's `_compute_llama3_parameters`
    (transformers/modeling_rope_utils.py), one frequency at a time as Meta's `apply_scaling` writes it."""
    import math

    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_freq_wavelen:
            out.append(f)
        elif wavelen > low_freq_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out, np.float64)


def hf_llama_forward_numpy(sd, cfg, tokens, cache=None):
    """The HF LlamaForCausalLM forward in numpy, from its modeling code: weights as HF stores them ([out, in]),
    RMSNorm as weight * x / sqrt(mean(x^2) + eps), RoPE with rotate_half on the two halves of each head,
    repeat_kv for GQA, SiLU(gate) * up, causal softmax attention, lm_head (or the tied embedding).
    With config.json's value_residual (an exported ResFormer / SVFormer / SkipV1Former), layer i >= 1 attends
    over l1 V_1 + l2 V_i (Eq. 7; lambda tensors where learned, convex_lambda as (l, 1 - l)), (1 - g) V_i + g V_1
    (gated, g = sigmoid(x W_g)), V_1 (Eq. 10) or V_i's own heads then V_1's others (SkipV1); a layer with a value
    table first adds it, a V + b VE or V + 2 sigmoid(x W) VE; as modeling_resformer.py does."""
    E, H = cfg["hidden_size"], cfg["num_attention_heads"]
    K, L, eps = cfg.get("num_key_value_heads", H), cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    D = E // H
    rp = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else {})
    f64 = lambda x: np.asarray(x, np.float64)

    def norm(x, w):
        return f64(w) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)

    def rotate_half(x):
        return np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], -1)

    B, T = tokens.shape
    cache = [{} for _ in range(L)] if cache is None else cache
    if not cache:
        cache.extend({} for _ in range(L))
    S0 = cache[0]["k"].shape[2] if "k" in cache[0] else 0  # tokens already cached
    keep = lambda i, name, x: cache[i].__setitem__(
        name, x if name not in cache[i] else np.concatenate([cache[i][name], x], 2)
    )
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv = llama3_inv_freq_numpy(inv, scaling)
    elif scaling.get("rope_type", scaling.get("type")) == "linear":
        inv = inv / scaling["factor"]
    freqs = np.arange(S0, S0 + T)[:, None] * inv[None]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]  # [1, 1, T, D]
    h = f64(sd["model.embed_tokens.weight"])[tokens]
    mode = cfg.get("value_residual", "none")
    fixed = np.asarray(cfg.get("resformer_fixed_lambdas") or [[0.5, 0.5]] * L, np.float64)
    if "model.lambda_logits" in sd:
        z = f64(sd["model.lambda_logits"])
        fixed[:, 0] = f64(sd["model.lambda_scale"]) * np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    sigmoid = lambda z: 1.0 / (1.0 + np.exp(-z))
    heads = lambda y_BxTxK: y_BxTxK.transpose(0, 2, 1)[..., None]  # a per-head, per-token weight: [B, K, T, 1]
    tables = cfg.get("layer_value_table") or [-1] * L
    VE = [f64(sd[f"model.value_embeds.{j}.weight"])[tokens] for j in range(cfg.get("value_embeddings", 0))]
    V1 = None
    for i in range(L):
        p = f"model.layers.{i}."
        x = norm(h, sd[p + "input_layernorm.weight"])
        q = (x @ f64(sd[p + "self_attn.q_proj.weight"]).T).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        k = (x @ f64(sd[p + "self_attn.k_proj.weight"]).T).reshape(B, T, K, D).transpose(0, 2, 1, 3)
        v = None
        if p + "self_attn.v_proj.weight" in sd:  # [B, K_own, T, D]: SkipV1Former's layers own K - r heads
            v = (x @ f64(sd[p + "self_attn.v_proj.weight"]).T).reshape(B, T, -1, D).transpose(0, 2, 1, 3)
        if tables[i] >= 0 and v is not None:  # value embeddings, before the mix
            ve = VE[tables[i]].reshape(B, T, K, D).transpose(0, 2, 1, 3)
            if p + "self_attn.ve_gate.weight" in sd:
                v = v + heads(2.0 * sigmoid(x @ f64(sd[p + "self_attn.ve_gate.weight"]).T)) * ve
            else:
                a, b = f64(sd[p + "self_attn.ve_lambdas"])
                v = a * v + b * ve
        if i == 0:
            V1 = v
        elif mode in ("svformer", "skipv1"):
            pass  # V_1 of every cached token is read below, after this layer's own heads are cached
        elif p + "self_attn.value_gate.weight" in sd:  # gated: lerp(V_i, V_1, g)
            g = heads(sigmoid(x @ f64(sd[p + "self_attn.value_gate.weight"]).T))
            v = (1.0 - g) * v + g * V1
        elif mode == "resformer":
            l1 = f64(sd[p + "self_attn.lambda1"]) if p + "self_attn.lambda1" in sd else fixed[i - 1, 0]
            l2 = f64(sd[p + "self_attn.lambda2"]) if p + "self_attn.lambda2" in sd else fixed[i - 1, 1]
            if p + "self_attn.convex_lambda" in sd:
                l1 = f64(sd[p + "self_attn.convex_lambda"])
                l2 = 1.0 - l1
            v = l1 * V1 + l2 * v  # Eq. 7
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keep(i, "k", k)
        if v is not None:
            keep(i, "v", v)
        k, v = cache[i]["k"], cache[i].get("v")
        if i > 0 and mode == "svformer":
            v = cache[0]["v"]  # Eq. 10
        elif i > 0 and mode == "skipv1":  # own heads first, then layer 1's remaining heads
            v = cache[0]["v"] if v is None else np.concatenate([v, cache[0]["v"][:, v.shape[1] :]], axis=1)
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
        s = np.where(np.arange(S0 + T)[None] <= np.arange(S0, S0 + T)[:, None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        u = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, E)
        h = h + u @ f64(sd[p + "self_attn.o_proj.weight"]).T
        y = norm(h, sd[p + "post_attention_layernorm.weight"])
        g, up = y @ f64(sd[p + "mlp.gate_proj.weight"]).T, y @ f64(sd[p + "mlp.up_proj.weight"]).T
        h = h + (g / (1 + np.exp(-g)) * up) @ f64(sd[p + "mlp.down_proj.weight"]).T
    h = norm(h, sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return h @ f64(head).T


def hf_llama_greedy_numpy(sd, cfg, prompt, new_tokens):
    """Greedy decoding with the twin's cache (hf_llama_forward_numpy's `cache`): the prompt once, then one token a
    step. Returns the new tokens and the cache (its arrays: what each layer keeps)."""
    cache: list = []
    logits = hf_llama_forward_numpy(sd, cfg, np.asarray([prompt]), cache)
    out = []
    for i in range(new_tokens):
        out.append(int(logits[0, -1].argmax()))
        if i + 1 < new_tokens:  # as generate() does: the last token is returned, never fed back
            logits = hf_llama_forward_numpy(sd, cfg, np.asarray([[out[-1]]]), cache)
    return out, cache


def penalize(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, logit_bias=()):
    """OpenAI's logit bias ((token, bias) pairs added), then vLLM's penalties on one position's logits [V], as its
    apply_penalties writes them: a token of the prompt or the output has its logit divided by `repetition` where
    positive and multiplied by it otherwise; then frequency times the token's count in the output, and presence
    where the count is not 0, subtracted."""
    x = np.asarray(logits, np.float32).copy()
    for t, bias in logit_bias:
        x[t] += np.float32(bias)
    seen = np.zeros(x.shape, bool)
    seen[list(prompt) + list(output)] = True
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.size).astype(np.float32)
    x = np.where(seen & (x > 0), x / np.float32(repetition), np.where(seen, x * np.float32(repetition), x))
    return x - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)


def greedy_uncached(logits_fn, prompt, new_tokens, pad_to=None, eos_id=None, penalties=None, banned=None):
    """The engine's oracle: greedy decoding with no cache at all, the full forward over the whole prefix for each
    new token. logits_fn: tokens [1, T] -> logits [1, T, V]. pad_to: the prefix right-padded to this length (a
    causal model's logits at a position do not see the padding after it; one shape, one compile). eos_id: stop
    after it (kept). penalties: `penalize`'s (presence, frequency, repetition[, logit_bias]), applied before the
    argmax. banned: (the whole sequence so far, the new tokens so far) -> the ids that may not come next."""
    seq = [int(t) for t in prompt]
    for _ in range(new_tokens):
        tokens = np.zeros((1, pad_to or len(seq)), np.int32)
        tokens[0, : len(seq)] = seq
        logits = np.asarray(logits_fn(tokens))[0, len(seq) - 1]
        if banned is not None:
            logits = np.where(
                np.isin(np.arange(logits.shape[0]), list(banned(seq, seq[len(prompt) :]))), -np.inf, logits
            )
        if penalties is not None:
            logits = penalize(logits, prompt, seq[len(prompt) :], *penalties)
        seq.append(int(np.argmax(logits)))
        if seq[-1] == eos_id:
            break
    return seq[len(prompt) :]


def model_greedy(m, params, prompt, new_tokens, eos_id=None, penalties=None, banned=None):
    """greedy_uncached over a project model (ModelConfig m, its parameters), padded to a multiple of 32 tokens within
    the model's context: one compile serves every prompt of a length bucket."""
    apply = jitted_apply(m)
    pad_to = min(m.max_seq_len, -(-(len(prompt) + new_tokens) // 32) * 32)
    logits_fn = lambda t: apply({"params": params}, t)
    return greedy_uncached(logits_fn, prompt, new_tokens, pad_to, eos_id, penalties, banned)


@functools.cache
def jitted_apply(m):
    """The jitted forward of a project model (ModelConfig m), one per config for the whole test session."""
    from resformer_jax.model import Transformer

    return jax.jit(Transformer(m).apply)


def init_params(model, tokens, seed=0):
    """A Flax model's initial parameters, unboxed, computed op by op: a jitted init compiles every parameter's random
    draw anew for each model (2-3 s on 2 cores for a tiny one), while each eager op's compile serves every model of
    the process with that shape (0.2-0.4 s a model after the first)."""
    import flax.linen as nn

    return nn.unbox(model.init(jax.random.PRNGKey(seed), tokens)["params"])
