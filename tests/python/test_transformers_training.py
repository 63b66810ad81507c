"""The patched model where users put it: transformers.Trainer, gradient checkpointing,
save_pretrained / from_pretrained, a bf16 checkpoint."""
from __future__ import annotations

import copy

import pytest
import torch

from _hf_models import build, run

from dsa.integrations.transformers import fallback_counts, indexer_losses, patch


def _ids(batch, seq, seed=1):
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_gradient_checkpointing_same_gradients(kind):
    model = build(kind)
    ids = _ids(2, 40)
    plain = patch(copy.deepcopy(model), indexer_loss="sparse")
    checkpointed = patch(copy.deepcopy(model), indexer_loss="sparse")
    checkpointed.gradient_checkpointing_enable()
    a, b = run(plain, ids, use_cache=False), run(checkpointed, ids)
    assert torch.equal(a[0], b[0])
    for n in a[1]:
        if a[1][n] is None:
            assert b[1][n] is None, n
        else:
            # Recomputation repeats the same ops on the same inputs; only the order of
            # gradient accumulation may differ.
            torch.testing.assert_close(b[1][n], a[1][n], rtol=1e-6, atol=1e-10)
    assert fallback_counts(checkpointed) == {}


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_save_load_then_patch_same_logits(kind, tmp_path):
    from transformers import AutoModelForCausalLM
    model = patch(build(kind))
    ids = _ids(2, 40)
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
    model.save_pretrained(tmp_path)
    loaded = patch(AutoModelForCausalLM.from_pretrained(tmp_path))
    with torch.no_grad():
        after = loaded(input_ids=ids, use_cache=False).logits
    assert torch.equal(before, after)
    assert fallback_counts(loaded) == {}


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_bf16_checkpoint_trains(kind, tmp_path):
    from transformers import AutoModelForCausalLM
    build(kind).save_pretrained(tmp_path)
    # from_pretrained keeps the model's fp32 modules (sinks, biases, norms) in fp32 next to bf16 weights.
    model = patch(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), indexer_loss="sparse")
    assert model.dtype == torch.bfloat16
    ids = _ids(4, 40)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert fallback_counts(model) == {}
    assert indexer_losses(model)


def test_trainer_steps(tmp_path):
    from transformers import Trainer, TrainingArguments
    model = patch(build("v4"), indexer_loss="sparse")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = [{"input_ids": ids, "labels": ids} for ids in _ids(8, 40)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                             gradient_checkpointing=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])}
    indexer = {n for n in start if ".indexer." in n}
    assert indexer and indexer <= moved  # the indexer trains through the ordinary loss.backward()
    assert fallback_counts(model) == {}
