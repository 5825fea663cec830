"""Distinct experts read per decode step (64 rows) for a random-weight Qwen3-MoE, by prompt kind and sampling."""
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 512
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 16
torch.set_num_threads(1)
cfg = AutoConfig.for_model(
    "qwen3_moe", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(8, hidden // 128),
    num_key_value_heads=4, head_dim=64, intermediate_size=1024, moe_intermediate_size=32, num_experts=128,
    num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936,
    tie_word_embeddings=False, max_position_embeddings=4096)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
model = AutoModelForCausalLM.from_config(cfg).eval()
torch.set_default_dtype(torch.float32)
E, k, rows, plen, steps = 128, 8, 64, 64, 12
uniform = E * (1 - (1 - k / E) ** rows)
def run(ids_from, ids_to, mode, zero_head=False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(ids_from, ids_to, (rows, plen), generator=g)
    head = model.lm_head.weight.data.clone()
    if zero_head:
        model.lm_head.weight.data.zero_()
    distinct, uniq_tok = [], []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1].float()
        for _ in range(steps):
            if mode == "greedy":
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1)
            uniq_tok.append(nxt.unique().numel())
            out = model(nxt[:, None], past_key_values=past, use_cache=True, output_router_logits=True)
            past = out.past_key_values
            logits = out.logits[:, -1].float()
            d = [layer.float().view(rows, -1)[:, :E].topk(k, -1).indices.unique().numel()
                 for layer in out.router_logits]
            distinct.append(sum(d) / len(d))
    model.lm_head.weight.data.copy_(head)
    mean_distinct, mean_tokens = sum(distinct) / len(distinct), sum(uniq_tok) / len(uniq_tok)
    return round(mean_distinct, 1), round(mean_tokens, 1), [round(x) for x in distinct[:6]]
print("uniform", round(uniform, 1), "hidden", hidden, "layers", layers)
for name, lo, hi in [("t_words", 6000, 127990), ("english", 4107, 4107 + 1900)]:
    for mode in ("sampled", "greedy"):
        for zero in (False, True):
            print(name, mode, "zero_head" if zero else "", run(lo, hi, mode, zero), flush=True)
