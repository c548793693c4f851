"""A ragged batched pass: the new entries of many sessions as one sequence, with no padding.

The padded layout (specdec.runtime.batching) gives every call of a pass the widest call's rows, so
a 128-token prefill chunk beside seven one-row decode calls costs 8 × 128 rows. Here the calls'
new entries are laid end to end in one row of the batch:

    queries: [ session 0's new entries | session 1's new entries | ... ]   (no padding)

Every linear layer, norm and rotary embedding works row by row, so it runs once over the whole
sequence. Only attention needs to know whose row is whose: the model runs with no cache of its
own and the attention function (`use_ragged_attention` wraps the model's own) takes each session's
segment of the new keys and values, appends them to that session's own cache layer (as a pass of its own
would), and runs the model's own attention function (sdpa, or the float64 one of an int8 model)
on that segment's queries over that session's keys, with the session's own mask. A segment's
attention therefore gets exactly the inputs a pass of its own gives it, and at int8 its rows are
bitwise those of that pass (docs/algorithms.md §13–14; tested in tests/runtime/test_ragged.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The wrapped attention's registered name is this prefix + the model's own implementation's name.
RAGGED_PREFIX = "specdec_ragged_"


@dataclass(frozen=True)
class Segment:
    """One session's part of a ragged pass."""

    layers: Sequence  # the session's cache layers (growing layers): its new entries are appended here
    rows: slice  # its query rows in the pass
    mask: torch.Tensor  # additive [1, 1, new entries, cached + new entries], the session's own


@dataclass(frozen=True)
class RaggedPass:
    """What the ragged attention needs beside the pass's tensors (handed down as a model kwarg)."""

    segments: Sequence[Segment]


def _ragged_or(base: Callable) -> Callable:
    """`base` (the model's own attention function), run per segment in a ragged pass and as it is
    in every other pass."""

    def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  ragged: RaggedPass | None = None, **kwargs):
        if ragged is None:
            return base(module, query, key, value, attention_mask, **kwargs)
        # query [1, heads, rows, dim], key/value [1, kv heads, rows, dim]: each segment's new keys
        # and values go to its session's layer first, then its queries attend over that layer.
        index = module.layer_idx
        outputs = []
        for segment in ragged.segments:
            keys, values = segment.layers[index].update(key[:, :, segment.rows], value[:, :, segment.rows])
            output, _ = base(module, query[:, :, segment.rows], keys, values, segment.mask, **kwargs)
            outputs.append(output)  # [1, rows, heads, dim]
        return torch.cat(outputs, dim=1), None

    return attention


def use_ragged_attention(model) -> bool:
    """Make `model`'s attention able to run ragged passes (it behaves as before in every other
    pass); False where it cannot: an attention function transformers does not look up by name
    (eager), or attention modules without a layer index. Then the padded layout serves it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not isinstance(name, str):
        return False
    if name.startswith(RAGGED_PREFIX):
        return True
    if name not in ALL_ATTENTION_FUNCTIONS or name not in ALL_MASK_ATTENTION_FUNCTIONS:
        return False
    modules = [module for key, module in model.named_modules() if key.endswith("self_attn")]
    if not modules or not all(isinstance(getattr(module, "layer_idx", None), int) for module in modules):
        return False
    wrapped = RAGGED_PREFIX + name
    AttentionInterface.register(wrapped, _ragged_or(ALL_ATTENTION_FUNCTIONS[name]))
    ALL_MASK_ATTENTION_FUNCTIONS.register(wrapped, ALL_MASK_ATTENTION_FUNCTIONS[name])
    model.set_attn_implementation(wrapped)
    return model.config._attn_implementation == wrapped
