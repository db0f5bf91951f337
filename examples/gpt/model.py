"""A Llama-shaped decoder in plain PyTorch: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied embeddings.

Runs on torch 1.13 (explicit softmax attention) and on torch 2.x (F.scaled_dot_product_attention).
Attention is document-aware: given the position ids of a packed row (restarting at 0 in every
document piece, as pacer.data.Loader returns them), a token attends only to earlier tokens of
its own piece, so documents packed into one row do not see each other.

On a GPU with torch >= 2.5 the document mask goes to flex_attention as a block mask, which skips
the blocks that the mask empties and needs no dense [seq, seq] mask: on an H200 the 1b step took
0.308 s with it and 0.455 s with the dense mask in SDPA, both deterministic and bit-repeatable
(bench/results/gpt-profile-h200-2026-12-01/).
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class Config:
    vocab_size: int = 8000
    dim: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn_dim: int = 352
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"the head width {self.dim // self.heads} must be even for RoPE")


# From the CI model to about 1B parameters (the last is Llama-3.2-1B's body with this example's vocabulary).
CONFIGS = {
    "tiny": dict(dim=128, layers=2, heads=4, kv_heads=2, ffn_dim=352),
    "small": dict(dim=384, layers=6, heads=6, kv_heads=2, ffn_dim=1024),
    "125m": dict(dim=768, layers=12, heads=12, kv_heads=4, ffn_dim=2048),
    "350m": dict(dim=1024, layers=24, heads=16, kv_heads=4, ffn_dim=2816),
    "1b": dict(dim=2048, layers=16, heads=32, kv_heads=8, ffn_dim=8192, rope_theta=500000.0),
}


def config(name, vocab_size, **overrides):
    """The named configuration (CONFIGS) for a tokenizer of `vocab_size` pieces."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; one of {', '.join(CONFIGS)}")
    return Config(vocab_size=int(vocab_size), **{**CONFIGS[name], **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # In float32 whatever the activations' dtype: the mean of squares loses too much in bf16.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rope_tables(head_dim, max_len, theta, device=None):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x [batch, heads, seq, head_dim]; cos, sin [batch, 1, seq, head_dim/2] (pairs are the two halves)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


_HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")
ATTENTION = ("auto", "flex", "sdpa", "math")
_FLEX = []  # [compiled flex_attention, create_block_mask] once looked up; [None, None] when torch lacks them


def _flex():
    if not _FLEX:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            _FLEX.extend([torch.compile(flex_attention), create_block_mask])
        except (ImportError, AttributeError):
            _FLEX.extend([None, None])
    return _FLEX


def document_pieces(position_ids):
    """Int32 [batch, seq]: the index of each token's document piece (a piece starts where its position id is 0)."""
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=1)


def document_block_mask(position_ids):
    """flex_attention's block mask for document-causal attention over packed rows."""
    piece = document_pieces(position_ids)
    b, n = position_ids.shape

    def same_piece_causal(bi, h, q, kv):
        return (piece[bi, q] == piece[bi, kv]) & (q >= kv)

    return _flex()[1](same_piece_causal, b, None, n, n, device=position_ids.device)


def attention_mask(position_ids):
    """Bool [batch, 1, seq, seq]: True where query i may attend key j (j <= i, same document piece).

    A piece starts where its position id is 0; numbering pieces by a running count of starts
    gives each token its piece, and equal pieces plus causality is the mask.
    """
    piece = document_pieces(position_ids)
    n = position_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    same = piece[:, :, None] == piece[:, None, :]
    return (same & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.q = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.k = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)
        self.use_sdpa = True

    def forward(self, x, cos, sin, mask):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not isinstance(mask, torch.Tensor):  # a flex_attention block mask
            y = _flex()[0](q, k, v, block_mask=mask, enable_gqa=self.heads != self.kv_heads)
            return self.o(y.transpose(1, 2).reshape(b, n, -1))
        group = self.heads // self.kv_heads
        if group > 1:  # each key/value head serves `group` query heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        if _HAVE_SDPA and self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            scores = scores.masked_fill(~mask, float("-inf"))
            y = torch.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn = FeedForward(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, c, attention="auto"):
        """attention: "flex" (block mask; GPU, torch >= 2.5), "sdpa" (dense mask; torch >= 2.0), "math"
        (explicit softmax), or "auto" (flex on a GPU where torch has it, else sdpa where it exists, else math)."""
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}; one of {', '.join(ATTENTION)}")
        if attention == "sdpa" and not _HAVE_SDPA:
            raise ValueError(f"attention 'sdpa' needs torch >= 2.0 (this is {torch.__version__})")
        if attention == "flex" and _flex()[0] is None:
            raise ValueError(f"attention 'flex' needs torch >= 2.5 (this is {torch.__version__})")
        self.attention = attention
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)  # untied from the embedding
        cos, sin = rope_tables(c.dim // c.heads, c.max_seq_len, c.rope_theta)
        # Not state: derived from the config, so checkpoints hold only what training changes.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for block in self.blocks:
            block.attn.use_sdpa = attention != "math"
        self.apply(self._init)
        # Residual projections scaled down with depth (GPT-2's rule), so deep stacks start stable.
        for name, p in self.named_parameters():
            if name.endswith("attn.o.weight") or name.endswith("ffn.down.weight"):
                nn.init.normal_(p, mean=0.0, std=c.init_std / math.sqrt(2 * c.layers))

    def _init(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=self.config.init_std)

    def forward(self, tokens, position_ids=None):
        """tokens [batch, seq] int64 -> logits [batch, seq, vocab] (float32).

        position_ids [batch, seq] (restarting at 0 per document piece) make attention document-aware;
        without them each row is one sequence.
        """
        b, n = tokens.shape
        if n > self.config.max_seq_len:
            raise ValueError(f"sequence of {n} tokens exceeds max_seq_len {self.config.max_seq_len}")
        if position_ids is None:
            position_ids = torch.arange(n, device=tokens.device).expand(b, n)
        position_ids = position_ids.long()
        cos = self.rope_cos[position_ids][:, None]
        sin = self.rope_sin[position_ids][:, None]
        flex = self.attention == "flex" or (self.attention == "auto" and tokens.is_cuda and _flex()[0] is not None)
        mask = document_block_mask(position_ids) if flex else attention_mask(position_ids)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(self.norm(x)).float()

    def parameter_count(self):
        return sum(p.numel() for p in self.parameters())


def parameter_count(c):
    """Parameters of a config, counted without building it (a 1B model takes 4 GB in float32)."""
    head = c.dim // c.heads
    attn = c.dim * head * (2 * c.heads + 2 * c.kv_heads)
    per_layer = attn + 3 * c.dim * c.ffn_dim + 2 * c.dim
    return 2 * c.vocab_size * c.dim + c.layers * per_layer + c.dim


def labels_for(tokens, position_ids, lengths):
    """Next-token targets of packed rows: -100 where the next token is in another piece or is padding."""
    labels = torch.full_like(tokens, -100)
    n = tokens.shape[1]
    if n < 2:
        return labels
    real = torch.arange(n, device=tokens.device)[None, :] < lengths[:, None]
    keep = (position_ids[:, 1:] != 0) & real[:, 1:]
    labels[:, :-1] = torch.where(keep, tokens[:, 1:], labels[:, :-1])
    return labels


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
