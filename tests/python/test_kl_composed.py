"""A composed check of a DeepSeek-V3.2 layer's indexer training (docs/ops.md 5).

A tiny indexer (three linear projections of a fixed hidden state) is trained by
SGD to imitate a fixed main attention, first in the dense warm-up (dense
attention stats, dsa_dense_indexer_lse, dsa_dense_indexer_kl_loss), then in the
sparse stage (dsa_indexer top-k, sparse attention stats, dsa_kl_loss). In each
stage the KL must fall by at least half.

The main attention is dsa_sparse_attention itself (dense causal in the warm-up,
the indexer's selection in the sparse stage); its statistics feed the losses.
"""
import torch

import dsa

T, DM, H, D, HI, DI, TOPK = 96, 24, 4, 32, 4, 16, 16
SCALE = D ** -0.5
LENGTHS = [40, 96]  # two packed sequences


def attention_stats(query, kv, indices=None):
    """softmax_max / softmax_sum of the main attention (dense causal when indices is None)."""
    _, softmax_max, softmax_sum = dsa.dsa_sparse_attention(
        query, kv, indices, scale=SCALE, query_lengths=LENGTHS, key_lengths=LENGTHS)
    return softmax_max, softmax_sum


def make_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, DM, generator=g)
    # The main attention: MQA over one latent head, sharply peaked so the teacher is informative.
    query = (hidden @ torch.randn(DM, H * D, generator=g)).reshape(T, H, D) * 0.6
    kv = hidden @ torch.randn(DM, D, generator=g) * 0.6
    proj = [(torch.randn(DM, HI * DI, generator=g) * 0.1).requires_grad_(),
            (torch.randn(DM, DI, generator=g) * 0.1).requires_grad_(),
            (torch.randn(DM, HI, generator=g) * 0.1).requires_grad_()]
    return hidden, query, kv, proj


def indexer_inputs(hidden, proj):
    wq, wk, ww = proj
    return (hidden @ wq).reshape(T, HI, DI), hidden @ wk, hidden @ ww


def train(stage_loss, proj, steps, lr):
    opt = torch.optim.SGD(proj, lr=lr, momentum=0.9)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        loss = stage_loss()
        loss.backward()
        opt.step()
        history.append(loss.item())
    return history


def test_v32_dense_warmup_then_sparse_stage_train_the_indexer():
    hidden, query, kv, proj = make_layer()
    dense_max, dense_sum = attention_stats(query, kv)

    def dense_loss():
        iq, ik, w = indexer_inputs(hidden, proj)
        lse = dsa.dsa_dense_indexer_lse(iq, ik, w, query_lengths=LENGTHS, key_lengths=LENGTHS)
        return dsa.dsa_dense_indexer_kl_loss(iq, ik, w, query, kv.unsqueeze(1), dense_max, dense_sum, lse,
                                             scale=SCALE, query_lengths=LENGTHS, key_lengths=LENGTHS)

    dense = train(dense_loss, proj, steps=200, lr=0.1)
    assert dense[-1] <= 0.5 * dense[0], f"dense warm-up KL {dense[0]:.4f} -> {dense[-1]:.4f}"

    def sparse_loss():
        iq, ik, w = indexer_inputs(hidden, proj)
        indices = dsa.dsa_indexer(iq, ik, w, topk=TOPK, query_lengths=LENGTHS, key_lengths=LENGTHS)
        sparse_max, sparse_sum = attention_stats(query, kv, indices)
        return dsa.dsa_kl_loss(query, kv, indices, sparse_max, sparse_sum, iq, ik, w, scale=SCALE,
                               query_lengths=LENGTHS, key_lengths=LENGTHS)

    # A fresh indexer for the sparse stage, so its KL starts from an untrained selection.
    _, _, _, proj[:] = make_layer(seed=1)
    proj[:] = [p.detach().requires_grad_() for p in proj]
    sparse = train(sparse_loss, proj, steps=200, lr=0.1)
    assert sparse[-1] <= 0.5 * sparse[0], f"sparse-stage KL {sparse[0]:.4f} -> {sparse[-1]:.4f}"
