"""ResFormer / SVFormer for Hugging Face transformers (trust_remote_code=True), written by resformer_jax.export.

The Llama architecture (LlamaConfig, the same tensor names) with the value residual of "Value Residual
Learning" (Zhou et al., arXiv 2410.17897), exactly as resformer_jax computes it: layer 1 is standard and
produces V_1; layer n >= 2 attends with its own attention matrix over
  resformer  l1 * V_1 + l2 * V_n   (Eq. 7; l1, l2 fixed per layer, or the learned lambda1/lambda2 tensors;
                                    convex: l1 = convex_lambda, l2 = 1 - convex_lambda)
             (1 - g) V_n + g V_1   (gated: g = sigmoid(x W_g) per value head and token, x-transformers)
  svformer   V_1                   (Eq. 10; these layers have no v_proj)
  skipv1     [V_n heads 1..K-r; V_1 heads K-r+1..K]  (SkipV1Former: v_proj has K - r heads)
Value embeddings (modded-nanogpt): layers i and L+1-i add table VE_i[token] to V_n as a V_n + b VE
(ve_lambdas) or V_n + 2 sigmoid(x W) VE (ve_gate), before the mix.
Values are in key/value-head layout (GQA) and never rotated; RoPE in the rotate-half convention.
The KV cache is transformers' own DynamicCache, holding per layer exactly what its equation needs: layer 1 its K
and V_1; a layer attending over V_1 (SVFormer, Eq. 10) its K only (an empty value of head_dim 0) and reads V_1 from
layer 1's entry; SkipV1Former's layers their own value heads; mixing layers (Eq. 7, gated) their mixed value, which
is per token. So an SVFormer's cache is (L+1)/(2L) of a vanilla Llama's bytes.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, LlamaConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5.2x names the cache `cache`; earlier releases `past_key_values`: the output field is whichever exists
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cached_values(cache, layer):
    """The values a cache holds for a layer: [B, heads, S, D] (.layers in transformers >= 4.56, value_cache before)."""
    return cache.layers[layer].values if hasattr(cache, "layers") else cache.value_cache[layer]


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (self.weight.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        E, H = config.hidden_size, config.num_attention_heads
        self.H, self.K, self.D = H, config.num_key_value_heads, E // H
        self.layer = layer
        self.q_proj = nn.Linear(E, H * self.D, bias=False)
        self.k_proj = nn.Linear(E, self.K * self.D, bias=False)
        # The exporter writes each layer's plan (resformer_jax's LayerPlan): whether it owns W_V and with how many
        # heads, which value it attends over ("own": V_n, "first": V_1, "lambda_mix": l1 V_1 + l2 V_n, "skipv1",
        # "gated"), and which value-embedding table it adds (-1: none).
        L = config.num_hidden_layers
        self.owns_value = config.layer_owns_value[layer]
        self.value_heads = (getattr(config, "layer_value_heads", None) or [self.K] * L)[layer]
        self.value_mix = config.layer_value_mix[layer]
        self.value_table = (getattr(config, "layer_value_table", None) or [-1] * L)[layer]
        if self.owns_value:
            self.v_proj = nn.Linear(E, self.value_heads * self.D, bias=False)
        self.o_proj = nn.Linear(H * self.D, E, bias=False)
        # Learned lambdas are parameters of the mixing layers (their layout is the lambda mode's, not the variant's).
        lambdas = config.resformer_lambdas
        if self.value_mix == "lambda_mix" and lambdas == "learnable":
            self.lambda1 = nn.Parameter(torch.zeros(()))
        if self.value_mix == "lambda_mix" and lambdas in ("learnable", "learnable_plus"):
            self.lambda2 = nn.Parameter(torch.zeros(()))
        if self.value_mix == "lambda_mix" and lambdas == "convex":
            self.convex_lambda = nn.Parameter(torch.zeros(()))
        if self.value_mix == "gated":
            self.value_gate = nn.Linear(E, self.K, bias=False)
        if self.value_table >= 0 and getattr(config, "value_embedding_gate", False):
            self.ve_gate = nn.Linear(E, self.K, bias=False)
        elif self.value_table >= 0:
            self.ve_lambdas = nn.Parameter(torch.zeros(2))

    def heads(self, y):
        """[B, T, K] -> [B, K, T, 1]: a per-head, per-token weight in value layout."""
        return y.transpose(1, 2)[..., None]

    def forward(self, x, cos, sin, v1, lambdas, value_embeds, cache, mask):
        """x: the new tokens [B, T, E]; v1: layer 1's values of the new tokens; cache: the DynamicCache, updated in
        place with what this layer keeps; mask: [B, 1, T, S] True where a new token may attend a cached one."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.K, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.value_heads, self.D).transpose(1, 2) if self.owns_value else None
        if self.value_table >= 0 and v is not None:  # value embeddings, added before any mix
            ve = value_embeds[self.value_table].view(B, T, self.K, self.D).transpose(1, 2)
            if hasattr(self, "ve_gate"):
                v = (v + self.heads(2.0 * torch.sigmoid(self.ve_gate(x).float())) * ve).to(v.dtype)
            else:
                v = (self.ve_lambdas[0] * v + self.ve_lambdas[1] * ve).to(v.dtype)
        if self.value_mix in ("own", "first", "skipv1"):
            v_att = v  # what the cache keeps: V_n, nothing (Eq. 10), the own heads; V_1 is read from layer 1's entry
        elif self.value_mix == "gated":
            g = self.heads(torch.sigmoid(self.value_gate(x).float()))
            v_att = ((1.0 - g) * v + g * v1).to(v.dtype)
        else:
            l1 = getattr(self, "lambda1", None)
            l2 = getattr(self, "lambda2", None)
            if hasattr(self, "convex_lambda"):
                l1, l2 = self.convex_lambda, 1.0 - self.convex_lambda
            l1 = lambdas[0] if l1 is None else l1
            l2 = lambdas[1] if l2 is None else l2
            v_att = (l1 * v1 + l2 * v).to(v.dtype)  # Eq. 7
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if v_att is None:  # no value of its own (Eq. 10; SkipV1 reusing every head): zero heads, zero bytes
            v_att = k.new_zeros(B, 0, T, self.D)
        k, v_att = cache.update(k, v_att, self.layer)
        if self.value_mix == "first":
            v_att = cached_values(cache, 0)  # Eq. 10: V_1 of every cached token
        elif self.value_mix == "skipv1":  # the layer's own heads, then layer 1's remaining ones
            v1_all = cached_values(cache, 0)
            v_att = torch.cat([v_att, v1_all[:, v_att.shape[1] :]], dim=1).to(v1_all.dtype)
        G = self.H // self.K
        kr, vr = k.repeat_interleave(G, dim=1), v_att.repeat_interleave(G, dim=1)
        s = (q.float() @ kr.float().transpose(-1, -2)) / math.sqrt(self.D)
        s = s.masked_fill(~mask, torch.finfo(torch.float32).min)  # finite: a left-padding row stays a number
        u = (F.softmax(s, dim=-1) @ vr.float()).to(x.dtype)
        return self.o_proj(u.transpose(1, 2).reshape(B, T, -1)), (v if self.layer == 0 else None)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, Fd = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(E, Fd, bias=False), nn.Linear(E, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, E, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, cos, sin, v1, lambdas, value_embeds, cache, mask):
        a, v = self.self_attn(self.input_layernorm(h), cos, sin, v1, lambdas, value_embeds, cache, mask)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), v


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        kv_width = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
        self.value_embeds = nn.ModuleList(
            [nn.Embedding(config.vocab_size, kv_width) for _ in range(getattr(config, "value_embeddings", 0))]
        )
        if "lambda_mix" in config.layer_value_mix and config.resformer_lambdas == "learnable_plus":
            self.lambda_logits = nn.Parameter(torch.zeros(config.num_hidden_layers - 1))
            self.lambda_scale = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, cache, attention_mask=None, position_ids=None):
        """input_ids [B, T]: the tokens after the S0 the cache holds; attention_mask [B, S0 + T] (0: padding)."""
        c = self.config
        B, T = input_ids.shape
        dev = input_ids.device
        past = cache.get_seq_length()
        if position_ids is None and attention_mask is not None:  # left padding: positions count the real tokens
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=dev)[None].expand(B, T)
        mask = torch.arange(past + T, device=dev)[None] <= torch.arange(past, past + T, device=dev)[:, None]
        mask = mask[None, None]  # [1, 1, T, S]: causal over the cache and the new tokens
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, -(past + T) :]
        D = c.hidden_size // c.num_attention_heads
        theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=dev).float() / D))
        ang = position_ids.float()[..., None] * inv  # [B, T, D/2]
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, T, D]
        fixed = (
            torch.tensor(c.resformer_fixed_lambdas, dtype=torch.float32) if "lambda_mix" in c.layer_value_mix else None
        )
        if hasattr(self, "lambda_logits"):
            fixed = fixed.clone()
            fixed[:, 0] = self.lambda_scale * torch.softmax(self.lambda_logits, dim=0)
        h = self.embed_tokens(input_ids)
        value_embeds = [e(input_ids) for e in self.value_embeds]
        v1 = None
        for i, layer in enumerate(self.layers):
            lambdas = fixed[i - 1] if (fixed is not None and i > 0) else None
            h, v = layer(h, cos.to(h.dtype), sin.to(h.dtype), v1, lambdas, value_embeds, cache, mask)
            if i == 0:
                v1 = v
        return self.norm(h)


class ResFormerLlamaForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LlamaConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        past_key_values=None,
        use_cache=None,
        labels=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is None:  # a call without one still runs through a cache, its own, dropped unless asked for
            cache = DynamicCache()
        h = self.model(input_ids, cache, attention_mask=attention_mask, position_ids=position_ids)
        logits = self.lm_head(h).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
