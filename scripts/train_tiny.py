"""Train the small DeepSeek-V3-architecture model that `scripts/run.sh` serves by default.

    apt-get install fortunes        # the corpus: Debian's fortune cookies, /usr/share/games/fortunes
    .venv/bin/python scripts/train_tiny.py --out models/tiny-fortunes

The model is transformers' own DeepseekV3ForCausalLM (its forward is the parity reference anyway), sized for
a 2-core CPU: MLA with q_lora, one dense layer then MoE layers of 16 routed experts (4 groups, top-2 groups,
top-4 experts) and a shared expert, sigmoid scores with DeepSeek-V3's aux-loss-free balancing: after every
step each MoE layer's `e_score_correction_bias` moves by `--bias-speed` towards balance (up for experts that
got fewer than the mean tokens, down for those that got more), as DeepSeek-V3 trains.

Corpus: every fortune file of Debian's `fortunes` package (~2.5 MB of short English texts: jokes,
quotations, definitions, verse), except ASCII art; each fortune is one document. Every 20th fortune (in a
fixed order) is held out. A quarter of the training fortunes also appear as a chat turn (a user asks for a
fortune in one of a few phrasings; the assistant answers with it), so the chat template gets an answer.
The tokenizer is a byte-level BPE (`tokenizers`) trained on the training fortunes.

Writes to --out: the checkpoint in DeepSeek's format (bf16 safetensors, config.json, tokenizer, chat
template), heldout.txt (a slice of the held-out fortunes, for the perplexity test), loss.png, and README.md
(the model card: command, corpus, loss, held-out perplexity). Reproducible: fixed seeds, one thread order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eval_perplexity import nll_reference, token_docs
from moe_serve.moe.tiny import load_reference_model, shipped_layout, write_checkpoint
from moe_serve.moe.tiny_tokenizer import train_tokenizer

CORPUS_DIR = Path("/usr/share/games/fortunes")
SKIP_FILES = {"ascii-art"}  # pictures, not text
HELD_OUT_EVERY = 20
CHAT_EVERY = 4
CHAT_ASKS = ["Tell me a fortune.", "Say something wise.", "Give me a quote.", "Tell me something funny.",
             "What do you have for me today?"]
ARCH = dict(
    hidden_size=256, num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=512,
    moe_intermediate_size=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
    topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=1024, rope_theta=10000.0, rope_scaling=None,
    rope_interleave=True, tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
    initializer_range=0.02, attention_bias=False, num_nextn_predict_layers=0,  # no multi-token-prediction layer
)


def read_fortunes(corpus_dir: Path) -> list[str]:
    """Every fortune (text between lines holding a single '%') of the package's files, in file-name order."""
    files = sorted(p for p in corpus_dir.iterdir()
                   if p.is_file() and not p.suffix and not p.is_symlink() and p.name not in SKIP_FILES)
    if not files:
        raise SystemExit(f"no fortune files in {corpus_dir}: install Debian's `fortunes` package "
                         "(apt-get install fortunes)")
    out = []
    for path in files:
        for chunk in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = chunk.strip("\n%").rstrip()
            if text.strip():
                out.append(text)
    return out


def token_stream(tok, fortunes: list[str], chat: bool) -> list[int]:
    """<bos> fortune <eos> per document; with chat, every CHAT_EVERY-th fortune again as a chat turn."""
    ids: list[int] = []
    for i, text in enumerate(fortunes):
        ids += tok.encode(text, add_special_tokens=True) + [tok.eos_token_id]
        if chat and i % CHAT_EVERY == 0:
            messages = [{"role": "user", "content": CHAT_ASKS[i // CHAT_EVERY % len(CHAT_ASKS)]},
                        {"role": "assistant", "content": text}]
            ids += tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    return ids


class LoadCounter:
    """Per MoE layer, how many token slots each routed expert got since the last `take` (hooks on the routers)."""

    def __init__(self, model):
        self.routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.counts = [torch.zeros(r.e_score_correction_bias.numel()) for r in self.routers]
        for router, counts in zip(self.routers, self.counts):
            router.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts: torch.Tensor):
        def count(_module, _inputs, outputs) -> None:  # outputs: (logits, top-k weights, top-k ids)
            counts.add_(torch.bincount(outputs[-1].reshape(-1), minlength=counts.numel()).float())
        return count

    def take(self) -> list[torch.Tensor]:
        got = [c.clone() for c in self.counts]
        for c in self.counts:
            c.zero_()
        return got


def update_bias(counter: LoadCounter, speed: float) -> float:
    """DeepSeek-V3's aux-loss-free balancing step; returns the mean over layers of max load / mean load."""
    imbalance = []
    for router, load in zip(counter.routers, counter.take()):
        router.e_score_correction_bias.add_(speed * torch.sign(load.mean() - load))
        imbalance.append((load.max() / load.mean().clamp(min=1)).item())
    return sum(imbalance) / len(imbalance)


def perplexity(model_dir: Path, tok, texts: list[str], seq_len: int, model=None) -> float:
    """exp(mean next-token NLL) over the documents, each scored on its own (<bos> text <eos>, cut at seq_len)."""
    nll, count = nll_reference(model_dir, token_docs(tok, texts, seq_len + 1), model)
    return math.exp(nll / count)


def plot_loss(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="training loss (mean of 10 steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tiny-fortunes")
    ap.add_argument("--corpus-dir", type=Path, default=CORPUS_DIR)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--bias-speed", type=float, default=2e-3, help="e_score_correction_bias step per update")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--heldout-ship", type=int, default=64, help="held-out fortunes written to heldout.txt")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    t_start = time.perf_counter()

    fortunes = read_fortunes(args.corpus_dir)
    held_out = fortunes[::HELD_OUT_EVERY]
    train = [f for i, f in enumerate(fortunes) if i % HELD_OUT_EVERY]
    tok = train_tokenizer((f + "\n" for f in train), args.vocab_size)
    stream = torch.tensor(token_stream(tok, train, chat=True))
    print(f"[train] {len(fortunes)} fortunes ({sum(map(len, fortunes)) / 1e6:.2f} MB): {len(train)} train, "
          f"{len(held_out)} held out; vocab {len(tok)}; {stream.numel():,} training tokens", flush=True)

    config = AutoConfig.for_model("deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=len(tok),
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **ARCH)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"[train] DeepseekV3ForCausalLM, {params / 1e6:.2f} M parameters", flush=True)
    counter = LoadCounter(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    history, window, imbalance = [], [], []
    for step in range(args.steps):
        starts = torch.randint(0, stream.numel() - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[s: s + args.seq_len + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            imbalance.append(update_bias(counter, args.bias_speed))
        window.append(loss.item())
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - t_start
            history.append({"step": step + 1, "loss": sum(window) / len(window), "lr": lr_at(step),
                            "max_over_mean_load": sum(imbalance) / len(imbalance), "elapsed_s": elapsed})
            window, imbalance = [], []
            h = history[-1]
            print(f"[train] step {h['step']}/{args.steps} loss {h['loss']:.3f} lr {h['lr']:.2e} "
                  f"expert load max/mean {h['max_over_mean_load']:.2f} ({elapsed:.0f} s)", flush=True)

    model.eval()
    sd = {k: v.detach().float() for k, v in shipped_layout(model.state_dict()).items()}
    write_checkpoint(out, config, sd, tok, "bfloat16", num_shards=1, explicit=ARCH)
    shipped = load_reference_model(out, torch.float32)  # the bf16 weights as shipped
    ppl_train = perplexity(out, tok, train[::HELD_OUT_EVERY][:len(held_out)], args.seq_len, shipped)
    ppl_held = perplexity(out, tok, held_out, args.seq_len, shipped)
    (out / "heldout.txt").write_text("\n%\n".join(held_out[:args.heldout_ship]) + "\n")
    plot_loss(history, out / "loss.png")
    train_s = time.perf_counter() - t_start
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "args": {k: str(v) for k, v in
              vars(args).items()}, "parameters": params, "training_tokens": stream.numel(),
              "tokens_seen": args.steps * args.batch_size * args.seq_len, "heldout_perplexity": ppl_held,
              "train_sample_perplexity": ppl_train, "seconds": train_s, "torch": torch.__version__,
              "cpu": platform.processor() or platform.machine(), "history": history}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"[train] held-out perplexity {ppl_held:.2f} (training sample {ppl_train:.2f}); {train_s:.0f} s in all",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
