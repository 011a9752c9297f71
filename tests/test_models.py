"""Tests for fsdp_lab.models: the small Llama and the synthetic data."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab.models import (
    CONFIGS,
    Batch,
    Llama,
    LlamaConfig,
    apply_activation_checkpointing,
    count_parameters,
    global_batch,
    markov_chain,
    parameter_breakdown,
    shard_batch,
    synthetic_batch,
)
from fsdp_lab.models.llama import Attention, RMSNorm, apply_rotary, rope_tables

CPU = LlamaConfig.from_name("cpu")


def tokens(batch_size=2, seq_len=16, seed=0, vocab_size=CPU.vocab_size):
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- configs and parameter counts

def test_cpu_breakdown_worked_by_hand():
    # dim 128, 4 heads of 32, 2 kv heads, ffn 352, vocab 512, 4 layers
    attention = 128 * 128 + 2 * (128 * 64) + 128 * 128
    feed_forward = 3 * 128 * 352
    per_layer = attention + feed_forward + 2 * 128
    parts = parameter_breakdown(CPU)
    assert parts["attention_per_layer"] == attention == 49152
    assert parts["feed_forward_per_layer"] == feed_forward == 135168
    assert parts["per_layer"] == per_layer
    assert parts["output"] == 512 * 128 and parameter_breakdown(CONFIGS["cpu-tied"])["output"] == 0
    assert count_parameters(CPU) == 512 * 128 + 4 * per_layer + 128 + 512 * 128 == 869504


@pytest.mark.parametrize("name", ["cpu", "cpu-tied"])
def test_count_matches_numel(name):
    model = Llama(name)
    assert count_parameters(CONFIGS[name]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, published", [("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248)])
def test_published_sizes_on_meta(name, published):
    with torch.device("meta"):
        model = Llama(name)
    assert sum(p.numel() for p in model.parameters()) == published
    assert count_parameters(CONFIGS[name]) == published


def test_breakdown_matches_modules():
    model = Llama("cpu")
    parts = parameter_breakdown(CPU)
    block = model.layers[0]
    assert parts["attention_per_layer"] == sum(p.numel() for p in block.attention.parameters())
    assert parts["feed_forward_per_layer"] == sum(p.numel() for p in block.feed_forward.parameters())
    assert parts["embeddings"] == model.tok_embeddings.weight.numel()


def test_config_validation():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        LlamaConfig(dim=100, n_heads=3)
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_layers must be a positive int"):
        LlamaConfig(n_layers=0)
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        LlamaConfig.from_name("cpu", vocab_size=-1)
    with pytest.raises(ValueError, match="llama2-7b"):  # the message lists the known names
        LlamaConfig.from_name("llama-9000")
    assert LlamaConfig.from_name("cpu", n_layers=2).n_layers == 2
    assert CONFIGS["cpu"].n_layers == 4  # overrides do not touch the registry


def test_qwen_like_switches_build_counted_parameters_and_refuse_bad_heads():
    """Heads set apart from dim (5 heads of 24 on dim 96), q/k/v biases, q/k head norms: the
    counts are the modules' own, biases start at zero and the head norms at one."""
    config = LlamaConfig(dim=96, n_heads=5, n_kv_heads=1, explicit_head_dim=24, qkv_bias=True, qk_norm=True)
    model = Llama(config)
    attention = model.layers[0].attention
    assert attention.wq.weight.shape == (120, 96) and attention.wo.weight.shape == (96, 120)
    assert attention.wk.bias.shape == attention.wv.bias.shape == (24,) and attention.wo.bias is None
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (24,)
    by_hand = 120 * 96 + 2 * 24 * 96 + 96 * 120 + (120 + 2 * 24) + 2 * 24
    assert parameter_breakdown(config)["attention_per_layer"] == by_hand == sum(
        p.numel() for p in attention.parameters())
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())
    assert all(not b.any() for b in (attention.wq.bias, attention.wk.bias, attention.wv.bias))
    assert bool((attention.q_norm.weight == 1).all())
    assert model(torch.randint(0, 512, (2, 8))).logits.shape == (2, 8, 512)
    with pytest.raises(ValueError, match="divisible by n_heads .* or set explicit_head_dim"):
        LlamaConfig(dim=96, n_heads=5, n_kv_heads=1)
    with pytest.raises(ValueError, match="head_dim \\(25\\) must be even"):
        LlamaConfig(dim=96, n_heads=5, n_kv_heads=1, explicit_head_dim=25)
    with pytest.raises(ValueError, match="explicit_head_dim must be a positive int"):
        LlamaConfig(explicit_head_dim=0)
    with pytest.raises(TypeError, match="LlamaConfig.qkv_bias must be True or False, got 'no'"):
        LlamaConfig(qkv_bias="no")


@pytest.mark.parametrize("make, field", [
    (lambda: LlamaConfig(n_layers=True), "LlamaConfig.n_layers"),
    (lambda: synthetic_batch(64, True, 8), "batch_size"),
    (lambda: synthetic_batch(64, 2, 8).split(True), "microbatch_size"),
])
def test_sizes_refuse_bools(make, field):
    # True == 1 in Python: a flag passed where a size belongs would silently mean 1
    with pytest.raises(ValueError, match=f"{field} must be a positive int, got True"):
        make()


# ---------------------------------------------------------------- construction and init

class RecordDevices(TorchDispatchMode):
    """Records the device of every tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.devices = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
        return out


def test_meta_construction_allocates_nothing():
    with RecordDevices() as record, torch.device("meta"):
        model = Llama("llama3-8b")
    assert record.devices == {"meta"}
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def test_meta_to_empty_then_init_weights_equals_direct_construction():
    with torch.device("meta"):
        lazy = Llama("cpu")
    lazy.to_empty(device="cpu").init_weights(seed=3)
    eager = Llama("cpu", seed=3)
    for (name, a), (_, b) in zip(lazy.named_parameters(), eager.named_parameters()):
        assert torch.equal(a, b), name
    ids = tokens()
    torch.testing.assert_close(lazy(ids).logits, eager(ids).logits, rtol=0, atol=0)  # rope tables refilled


def test_init_is_deterministic_and_independent_of_global_rng():
    torch.manual_seed(1)
    a = Llama("cpu", seed=0)
    torch.manual_seed(2)
    torch.randn(1000)
    b = Llama("cpu", seed=0)
    c = Llama("cpu", seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - 0.02) < 0.002 and abs(pa.mean().item()) < 0.002


def test_state_dict_holds_parameters_only():
    model = Llama("cpu")
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    assert "layers.3.attention.wq.weight" in model.state_dict()
    assert "layers.0.feed_forward.w2.weight" in model.state_dict()


def test_tied_embeddings_share_one_parameter():
    model = Llama("cpu-tied")
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(list(Llama("cpu").parameters())) - 1
    model(tokens(), labels=tokens(seed=1)).loss.backward()
    # both uses (embedding lookup and output projection) add into the same .grad
    assert model.tok_embeddings.weight.grad is model.output.weight.grad


# ---------------------------------------------------------------- layers against hand-written references

def test_rmsnorm_matches_torch():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.weight, eps=1e-5))


def test_gqa_shapes_and_head_mapping():
    cfg = LlamaConfig(dim=64, n_heads=8, n_kv_heads=2)
    attn = Attention(cfg)
    head_dim = 8
    assert attn.wq.weight.shape == (8 * head_dim, 64)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (2 * head_dim, 64)
    assert attn.wo.weight.shape == (64, 8 * head_dim)

    # Reference: explicit loops, query head h uses kv head h // (n_heads / n_kv_heads), explicit causal mask.
    x = torch.randn(2, 6, 64)
    cos, sin = rope_tables(head_dim, 6, cfg.rope_theta)
    q = apply_rotary(attn.wq(x).view(2, 6, 8, head_dim).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.wk(x).view(2, 6, 2, head_dim).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(2, 6, 2, head_dim).transpose(1, 2)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    heads = []
    for h in range(8):
        kv = h // 4
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(head_dim)
        heads.append(scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, kv])
    expected = attn.wo(torch.cat(heads, dim=-1))
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-6)


def test_rope_matches_complex_rotation():
    head_dim, seq = 8, 10
    cos, sin = rope_tables(head_dim, seq, 10000.0)
    x = torch.randn(1, 1, seq, head_dim)
    # Feature pair (i, i + head_dim/2) is the complex number x_i + j x_{i+half}, turned by pos * theta^(-2i/d).
    half = head_dim // 2
    z = torch.complex(x[..., :half], x[..., half:])
    pos = torch.arange(seq, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    turned = z.to(torch.complex128) * torch.polar(torch.ones(seq, half, dtype=torch.float64), pos * freq)
    expected = torch.cat([turned.real, turned.imag], dim=-1).float()
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_offset():
    head_dim = 16
    cos, sin = rope_tables(head_dim, 64, 10000.0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(m, n):
        qm = apply_rotary(q.view(1, 1, 1, -1), cos[m:m + 1], sin[m:m + 1])
        kn = apply_rotary(k.view(1, 1, 1, -1), cos[n:n + 1], sin[n:n + 1])
        return (qm * kn).sum().item()

    for offset in (0, 3, 17):
        scores = [score(m + offset, m) for m in (0, 5, 30)]
        assert max(scores) - min(scores) < 1e-4, scores
    assert abs(score(3, 0) - score(0, 0)) > 1e-3  # and it does depend on the offset


# ---------------------------------------------------------------- forward, loss, training

def test_forward_shapes_and_batch_argument():
    model = Llama("cpu")
    batch = synthetic_batch(CPU.vocab_size, 3, 20, seed=0)
    out = model(batch)
    assert out.logits.shape == (3, 20, CPU.vocab_size)
    assert out.loss.shape == ()
    torch.testing.assert_close(out.loss, model(batch.input_ids, labels=batch.labels).loss, rtol=0, atol=0)
    expected = -out.logits.log_softmax(-1).gather(-1, batch.labels.unsqueeze(-1)).mean()
    torch.testing.assert_close(out.loss, expected)
    assert model(batch.input_ids).loss is None


def test_forward_rejects_bad_input():
    model = Llama("cpu")
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(seq_len=CPU.max_seq_len + 1))
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(2, 4))


def test_causal_masking():
    model = Llama("cpu")
    ids = tokens(seq_len=24)
    changed = ids.clone()
    changed[:, 15] = (changed[:, 15] + 1) % CPU.vocab_size
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-6)
    assert (a[:, 15:] - b[:, 15:]).abs().amax() > 1e-3


def test_loss_at_init_is_close_to_ln_vocab():
    model = Llama("cpu")
    loss = model(synthetic_batch(CPU.vocab_size, 8, 64)).loss.item()
    assert abs(loss - math.log(CPU.vocab_size)) < 0.1


def test_loss_decreases_with_adamw():
    torch.manual_seed(0)
    model = Llama("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        loss = model(synthetic_batch(CPU.vocab_size, 8, 64, step=step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


def test_activation_checkpointing_same_loss_and_grads_and_recomputes():
    batch = synthetic_batch(CPU.vocab_size, 4, 32)
    plain, checkpointed = Llama("cpu"), apply_activation_checkpointing(Llama("cpu"))
    calls = []
    checkpointed.layers[0].feed_forward.register_forward_pre_hook(lambda *_: calls.append(1))
    loss_plain, loss_ckpt = plain(batch).loss, checkpointed(batch).loss
    assert len(calls) == 1
    loss_plain.backward()
    loss_ckpt.backward()
    assert len(calls) == 2  # the block's forward ran again during backward
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="no TransformerBlock"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- data

def test_synthetic_batch_is_deterministic_per_seed_rank_step():
    state = torch.get_rng_state()
    a = synthetic_batch(512, 4, 32, seed=0, step=0, rank=0)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not used
    assert torch.equal(a.input_ids, synthetic_batch(512, 4, 32, seed=0, step=0, rank=0).input_ids)
    for other in (dict(seed=1), dict(step=1), dict(rank=1)):
        b = synthetic_batch(512, 4, 32, **{"seed": 0, "step": 0, "rank": 0, **other})
        assert not torch.equal(a.input_ids, b.input_ids), other


def test_synthetic_batch_follows_the_chain():
    batch = synthetic_batch(64, 4, 50, seed=2, step=7)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.long
    assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])  # labels are the next tokens
    table = markov_chain(64, seed=2)
    allowed = (table[batch.input_ids] == batch.labels.unsqueeze(-1)).any(-1)
    assert allowed.all()
    assert not (markov_chain(64, seed=3) == table).all()  # the chain depends on the seed


def test_global_batch_shards_round_trip():
    whole = global_batch(512, 8, 16, seed=0, step=3)
    shards = [shard_batch(whole, r, 4) for r in range(4)]
    assert [len(s) for s in shards] == [2, 2, 2, 2]
    assert torch.equal(torch.cat([s.input_ids for s in shards]), whole.input_ids)
    assert torch.equal(torch.cat([s.labels for s in shards]), whole.labels)
    with pytest.raises(ValueError, match="not divisible by world_size 3"):
        shard_batch(whole, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        shard_batch(whole, 4, 4)


def test_batch_split_chunk_and_to():
    batch = synthetic_batch(512, 5, 8)
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    assert [len(p) for p in batch.chunk(5)] == [1] * 5
    with pytest.raises(ValueError, match="equal"):
        batch.chunk(2)
    moved = batch.to("meta")
    assert moved.input_ids.is_meta and len(moved) == 5 and batch.num_tokens == 40
    with pytest.raises(ValueError, match="same shape|one shape"):
        Batch(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
