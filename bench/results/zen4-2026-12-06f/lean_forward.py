"""transformers' forward against a lean one over the same modules (embedding, per layer the norms,
projections, rotary, cache update, attention function and MLP, the final norm and the vocabulary
rows), no decorators, mask builders or output classes: bitwise the same logits, and what the
wrappers cost. One process, the two alternated, 8 rounds, after a 400-token prompt. Run from the
repo root (tried and not kept: ~1 ms a pass):

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/lean_forward.py
"""

import statistics
import time

import torch
import transformers.models.qwen2.modeling_qwen2 as qwen2
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bench.bench_grounded import load_hf_target
from bench.bench_pass import prompt_ids
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.kv import TreeKVCache, additive_mask

LEAN = [False]


def lean_logits(model, input_ids, mask, position_ids, cache, keep):
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids)
    attention = ALL_ATTENTION_FUNCTIONS[inner.config._attn_implementation]
    shape = hidden.shape[:-1]
    for layer in inner.layers:
        block = layer.self_attn
        heads = (*shape, -1, block.head_dim)
        x = layer.input_layernorm(hidden)
        q = block.q_proj(x).view(heads).transpose(1, 2)
        k = block.k_proj(x).view(heads).transpose(1, 2)
        v = block.v_proj(x).view(heads).transpose(1, 2)
        q, k = qwen2.apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.update(k, v, block.layer_idx)
        out, _ = attention(block, q, k, v, mask, dropout=0.0, scaling=block.scaling,
                           sliding_window=block.sliding_window)
        hidden = hidden + block.o_proj(out.reshape(*shape, -1).contiguous())
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden)[:, -keep:, :])


def main() -> None:
    transformers_forward = TreeKVCache.forward

    def forward(self, plan):
        if not LEAN[0]:
            return transformers_forward(self, plan)
        with torch.no_grad():
            mask = additive_mask(plan.allowed, torch.float32)[None, None]
            keep = len(plan.tokens) - plan.rows_from
            logits = lean_logits(self.model, torch.tensor([plan.tokens]), mask,
                                 torch.tensor([plan.positions]), self.cache, keep)
        return logits[0].float()

    TreeKVCache.forward = forward
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    vocab = loaded.info.vocab_size
    with torch.inference_mode():
        kv = TreeKVCache(loaded.model)
        kv.prefill(prompt_ids(vocab, 400))
        for n in (1, 4, 10):
            tokens, parents = [t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1))
            rows = {}
            for lean in (False, True):
                LEAN[0] = lean
                rows[lean] = kv.extend(tokens, parents)
                kv.settle([])
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(8):
                for lean in (False, True):
                    LEAN[0] = lean
                    began = time.perf_counter()
                    kv.extend(tokens, parents)
                    kv.settle([])
                    times[lean].append(time.perf_counter() - began)
            plain, lean_ = (1e3 * statistics.median(times[key]) for key in (False, True))
            print(f"T({n}): bitwise equal {torch.equal(rows[False], rows[True])}; transformers' forward "
                  f"{plain:.1f} ms, lean {lean_:.1f} ms")


if __name__ == "__main__":
    main()
