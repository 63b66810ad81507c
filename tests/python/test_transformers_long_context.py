"""No T x S tensor in a patched model: every tensor that a patched forward + backward
allocates (model, patch and ops, seen through torch's dispatcher: outputs of every op,
factory calls included, in the backward too) stays under T^2 / 64 bytes at T = 8192.

The models are tiny in width (every per-token tensor is at most 80 bytes a token, so
O(T) tensors stay under the bound at T = 8192 with 2x room) and full length: a dense
mask alone ([1, 1, T, T] bool) would be 64x the bound. The unpatched model breaks the
bound at a quarter of the length (the control that shows the check can fail)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from _hf_models import build

from dsa.integrations.transformers import fallback_counts, patch

T = 8192
BOUND = T * T // 64  # bytes: 1 MiB at T = 8192

NARROW = {
    "v32": dict(vocab_size=16, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_attention_heads=1,
                num_key_value_heads=1, q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=8, n_routed_experts=2, n_group=1,
                topk_group=1, num_experts_per_tok=1, max_position_embeddings=T),
    "v4": dict(vocab_size=16, hidden_size=8, moe_intermediate_size=8, num_attention_heads=1, head_dim=8,
               q_lora_rank=8, o_groups=1, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4,
               n_routed_experts=2, num_experts_per_tok=1, max_position_embeddings=T),
}


class LargestTensors(TorchDispatchMode):
    """The storage bytes of every tensor an op returns, with the op's name."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((t.untyped_storage().nbytes(), str(func), tuple(t.shape)))
        return out

    def over(self, bound):
        return sorted((s for s in self.seen if s[0] >= bound), reverse=True)[:5]


def _step(model, tokens, positions=None):
    ids = torch.randint(1, 16, (1, tokens), generator=torch.Generator().manual_seed(0))
    mode = LargestTensors()
    with mode:
        out = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)
        out.loss.backward()
    return mode


@pytest.mark.parametrize("kind, loss, packed", [("v32", "sparse", False), ("v32", "dense", False),
                                                ("v32", "sparse", True), ("v4", "sparse", False),
                                                ("v4", "sparse", True)])
def test_no_tensor_of_t_squared_over_64_bytes(kind, loss, packed):
    model = patch(build(kind, **NARROW[kind]), strict=True, indexer_loss=loss)
    positions = None
    if packed:  # three documents: position ids restarting at 0 (transformers' packed detection)
        positions = torch.cat([torch.arange(n) for n in (3000, 4000, T - 7000)]).unsqueeze(0)
    mode = _step(model, T, positions)
    assert fallback_counts(model) == {}
    assert mode.over(BOUND) == [], f"tensors of >= {BOUND} bytes at T = {T}: {mode.over(BOUND)}"
    assert len(mode.seen) > 100  # the mode saw the step's ops (forward and backward)
    assert any("sparse_attention_bwd" in s[1] for s in mode.seen)


@pytest.mark.parametrize("kind", ["v32", "v4"])
def test_the_unpatched_model_breaks_the_bound(kind):
    model = build(kind, **NARROW[kind])
    mode = _step(model, T // 4)
    assert mode.over(BOUND), "the unpatched model's dense masks should exceed the bound"
