#!/usr/bin/env python3
"""nanoGPT's training step on PyTorch, as its train.py runs it, timed: the baseline of nanodist's speed tables.

    python3 scripts/nanogpt_step.py '{"n_layers": 4, "n_heads": 4, "n_embd": 128, "vocab": 128, "context": 64,
        "batch": 12, "steps": 60, "warmup": 10, "threads": 2, "activation": "gelu_tanh", "attention": "sdpa",
        "data": "data/shakespeare_char/train.bin"}'

Prints {"tokens_per_s": ..., "loss": ...} for the steps after `warmup`. The model is scripts/torch_parity.py's
GPT (nanoGPT's). On CPU: f32 (bf16 autocast with "amp"), `threads` threads. On CUDA ("device": "cuda"): bf16
autocast, TF32 matmuls, fused AdamW, and torch.compile with "compile", as nanoGPT runs on a GPU.
"""
import contextlib, json, os, sys, time
import numpy as np, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_parity import GPT
cfg = json.loads(sys.argv[1])
dev = cfg.get("device", "cpu")
cuda = dev == "cuda"
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
if cuda:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
model = GPT(dict(n_layers=cfg["n_layers"], n_heads=cfg["n_heads"], n_embd=cfg["n_embd"], vocab_size=cfg["vocab"],
                 context_length=cfg["context"], bias=False, activation=cfg["activation"],
                 attention=cfg["attention"])).to(dev)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}))
if cfg.get("compile"):
    model = torch.compile(model)
amp = (lambda: torch.autocast(device_type=dev, dtype=torch.bfloat16)) if cuda or cfg.get("amp") \
    else contextlib.nullcontext
sync = torch.cuda.synchronize if cuda else (lambda: None)
data = np.memmap(cfg["data"], dtype=np.uint16, mode="r")
rng = np.random.default_rng(0)
T, B = cfg["context"], cfg["batch"]
def batch():
    ix = rng.integers(0, len(data) - T - 1, B)
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
    return x.to(dev), y.to(dev)
for step in range(cfg["steps"]):
    if step == cfg["warmup"]:
        sync()
        start = time.perf_counter()
    x, y = batch()
    with amp():
        _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
sync()
secs = time.perf_counter() - start
print(json.dumps({"tokens_per_s": (cfg["steps"] - cfg["warmup"]) * B * T / secs, "loss": loss.item()}))
