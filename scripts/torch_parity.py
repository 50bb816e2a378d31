#!/usr/bin/env python3
"""PyTorch reference for nanodist's model: nanoGPT's GPT-2 architecture, loaded with weights that
nanodist exported (Hugging Face GPT-2 layout), evaluated on nanodist's batch.

    cargo test --test it torch_parity::export -- --ignored   # writes tests/golden/parity_*.{safetensors,json}
    python3 scripts/torch_parity.py                     # writes tests/golden/parity_expected.json

The expected file is committed, so `cargo test` checks logits, loss and gradient norms without PyTorch.
"""
import json
import math
import os

import torch
import torch.nn as nn
from torch.nn import functional as F
from safetensors.torch import load_file

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "golden")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class LayerNorm(nn.Module):
    def __init__(self, n, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self, c, n_head, bias, act, sdpa=False):
        super().__init__()
        self.n_head = n_head
        self.sdpa = sdpa
        self.ln_1 = LayerNorm(c, bias)
        self.c_attn = nn.Linear(c, 3 * c, bias=bias)
        self.attn_proj = nn.Linear(c, c, bias=bias)
        self.ln_2 = LayerNorm(c, bias)
        self.c_fc = nn.Linear(c, 4 * c, bias=bias)
        self.mlp_proj = nn.Linear(4 * c, c, bias=bias)
        self.act = nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            # nanoGPT's path on PyTorch >= 2.0 (flash attention where the backend has it).
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
            return self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg["n_embd"]
        self.wte = nn.Embedding(cfg["vocab_size"], c)
        self.wpe = nn.Embedding(cfg["context_length"], c)
        # attention = "sdpa": nanoGPT's F.scaled_dot_product_attention(is_causal=True); else the T x T mask
        # materialized (nanoGPT's fallback; the parity reference).
        sdpa = cfg.get("attention") == "sdpa"
        self.h = nn.ModuleList(Block(c, cfg["n_heads"], cfg["bias"], cfg["activation"], sdpa)
                               for _ in range(cfg["n_layers"]))
        self.ln_f = LayerNorm(c, cfg["bias"])

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # lm head tied to the token embedding
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def hf_params(self):
        """(HF name, parameter, transposed?) for every parameter, as nanodist names them."""
        out = [("transformer.wte.weight", self.wte.weight, False), ("transformer.wpe.weight", self.wpe.weight, False)]
        for i, b in enumerate(self.h):
            p = f"transformer.h.{i}"
            mods = [("ln_1", b.ln_1), ("attn.c_attn", b.c_attn), ("attn.c_proj", b.attn_proj),
                    ("ln_2", b.ln_2), ("mlp.c_fc", b.c_fc), ("mlp.c_proj", b.mlp_proj)]
            for name, m in mods:
                out.append((f"{p}.{name}.weight", m.weight, isinstance(m, nn.Linear)))
                if m.bias is not None:
                    out.append((f"{p}.{name}.bias", m.bias, False))
        out.append(("transformer.ln_f.weight", self.ln_f.weight, False))
        if self.ln_f.bias is not None:
            out.append(("transformer.ln_f.bias", self.ln_f.bias, False))
        return out


def run_case(case):
    meta = json.load(open(os.path.join(GOLDEN, f"parity_{case}.json")))
    cfg = meta["model"]
    weights = load_file(os.path.join(GOLDEN, f"parity_{case}.safetensors"))
    model = GPT(cfg)
    with torch.no_grad():
        for name, param, conv1d in model.hf_params():
            w = weights[name]
            param.copy_(w.t() if conv1d else w)  # HF Conv1D stores [in, out]; nn.Linear is [out, in]
    x = torch.tensor(meta["x"]).view(meta["b"], meta["t"])
    y = torch.tensor(meta["y"]).view(meta["b"], meta["t"])
    logits, loss = model(x, y)
    loss.backward()
    grads = {name: p.grad.norm().item() for name, p, _ in model.hf_params()}
    return {
        "torch_version": torch.__version__,
        "loss": loss.item(),
        "logits": logits.detach().view(-1).tolist(),
        "grad_norms": grads,
    }


def main():
    torch.manual_seed(0)
    out = {case: run_case(case) for case in ("bias_gelu", "nobias_gelu_tanh")}
    with open(os.path.join(GOLDEN, "parity_expected.json"), "w") as f:
        json.dump(out, f)
    for case, r in out.items():
        print(f"{case}: loss {r['loss']:.6f}, {len(r['logits'])} logits, {len(r['grad_norms'])} gradient norms")


if __name__ == "__main__":
    main()
