"""LoRA adapters and QLoRA on one process: initial identity, frozen parameters, gradients
against a plain-autograd reference on the dequantized weights, training, merging, saving."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.qlora import (
    LoRALinear,
    NF4Tensor,
    apply_lora,
    lora_parameter_counts,
    merge_lora,
    to_nf4,
)

DIM, HIDDEN, VOCAB = 32, 48, 50


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        att = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1)
        return self.wo(att @ v)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.feed_forward(x)


class TinyLM(nn.Module):
    """Llama's module names (attention.wq ..., feed_forward.w1 ...) on a few small layers."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (4, 12), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _loss(model, batch):
    tokens, labels = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("quantize", [False, True])
def test_zero_init_b_gives_the_base_output(quantize):
    base = TinyLM()
    reference = copy.deepcopy(base)
    model = apply_lora(base, rank=4, alpha=8, quantize_base=quantize)
    tokens, _ = _batch()
    if quantize:
        # The reference is the same model with each target weight replaced by its dequantized
        # float values, computed by plain nn.Linear.
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                reference.get_submodule(name).weight.data = module.weight.dequantize()
    assert torch.equal(model(tokens), reference(tokens))


def test_only_adapters_train_and_counts():
    model = apply_lora(TinyLM(), rank=4, alpha=8)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # two adapters on 7 projections in 2 layers
    # By hand: rank * (in + out) per projection.
    per_layer = 4 * 4 * (DIM + DIM) + 2 * 4 * (DIM + HIDDEN) + 4 * (HIDDEN + DIM)
    frozen = VOCAB * DIM * 2 + 2 * (4 * DIM * DIM + 3 * DIM * HIDDEN)
    counts = lora_parameter_counts(model)
    assert counts.trainable == 2 * per_layer and counts.total == 2 * per_layer + frozen
    nf4 = [m.weight for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(nf4) == 14 and all(isinstance(w, NF4Tensor) and not w.requires_grad for w in nf4)


def test_gradients_match_dequantized_float_reference():
    g = torch.Generator().manual_seed(5)
    linear = nn.Linear(40, 24)
    linear.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
    lora = LoRALinear(linear, rank=3, alpha=6)
    with torch.no_grad():
        lora.lora_b.normal_(generator=g)  # non-zero B so A receives a gradient too
    x = torch.randn(2, 7, 40, generator=g, requires_grad=True)
    upstream = torch.randn(2, 7, 24, generator=g)
    lora(x).backward(upstream)
    # Independent reference: plain tensors, plain autograd, the dequantized weight as a constant.
    w = lora.weight.dequantize().clone()
    a = lora.lora_a.detach().clone().requires_grad_(True)
    b = lora.lora_b.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = x_ref @ w.T + lora.bias.detach() + (x_ref @ a.T @ b.T) * (6 / 3)
    y_ref.backward(upstream)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    assert torch.allclose(lora.lora_a.grad, a.grad, atol=1e-5)
    assert torch.allclose(lora.lora_b.grad, b.grad, atol=1e-5)
    assert lora.lora_a.grad.abs().sum() > 0 and lora.lora_b.grad.abs().sum() > 0
    assert lora.weight.grad is None and lora.bias.grad is None


def _train(model, steps=8, lr=1e-2):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = _loss(model, _batch(step % 2))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_qlora_trains_leaves_packed_bytes_and_merges():
    model = apply_lora(TinyLM(), rank=4, alpha=8, quantize_base=True)
    before = {n: (m.weight.packed.clone(), m.weight.scales.clone())
              for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    losses = _train(model)
    assert losses[-1] < losses[0] - 0.05
    for name, (packed, scales) in before.items():
        weight = model.get_submodule(name).weight
        assert torch.equal(weight.packed, packed) and torch.equal(weight.scales, scales)
    tokens, _ = _batch(9)
    with torch.no_grad():
        lora_out = model(tokens)
        merged = merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert all(type(m.wq.weight) is nn.Parameter for m in (b.attention for b in merged.layers))
        assert torch.allclose(merged(tokens), lora_out, atol=1e-5)


def test_qlora_state_dict_round_trip(tmp_path):
    model = apply_lora(TinyLM(0), rank=4, alpha=8)
    _train(model, steps=2)
    torch.save(model.state_dict(), tmp_path / "qlora.pt")
    fresh = apply_lora(TinyLM(1), rank=4, alpha=8)
    fresh.load_state_dict(torch.load(tmp_path / "qlora.pt", weights_only=True))
    tokens, _ = _batch(3)
    assert torch.equal(fresh(tokens), model(tokens))


def test_dropout_only_in_training():
    linear = nn.Linear(16, 8)
    lora = LoRALinear(linear, rank=2, alpha=4, dropout=0.5)
    with torch.no_grad():
        lora.lora_b.fill_(1.0)
    x = torch.randn(5, 16)
    lora.eval()
    expected = linear(x) + (x @ lora.lora_a.T @ lora.lora_b.T) * 2
    assert torch.allclose(lora(x), expected, atol=1e-6)
    lora.train()
    assert not torch.allclose(lora(x), expected, atol=1e-6)


def test_target_modules_as_peft_takes_them():
    def wrapped(targets):
        model = apply_lora(TinyLM(), target_modules=targets, quantize_base=False)
        return sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))

    every_linear = sorted(n for n, m in TinyLM().named_modules() if isinstance(m, nn.Linear) and n != "output")
    assert wrapped("all-linear") == every_linear and "output" not in every_linear  # PEFT: not the output layer
    assert wrapped(r"layers\.1\..*\.(wq|w2)") == ["layers.1.attention.wq", "layers.1.feed_forward.w2"]  # a regex
    assert wrapped("wq") == ["layers.0.attention.wq", "layers.1.attention.wq"]  # one string: still a suffix
    assert wrapped(["wq", "wk"]) == wrapped(r".*\.w[qk]")


def test_apply_lora_errors():
    with pytest.raises(ValueError, match="rank must be a positive"):
        apply_lora(TinyLM(), rank=0)
    with pytest.raises(ValueError, match=r"no module matched.*layers\.0\.attention\.wq"):
        apply_lora(TinyLM(), target_modules=("q_proj",))
    with pytest.raises(TypeError, match="not nn.Linear"):
        apply_lora(TinyLM(), target_modules=("tok_embeddings",))
    model = apply_lora(TinyLM(), target_modules=("wq",))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, target_modules=("wq",))
    with pytest.raises(ValueError, match="rank must be a positive"):
        LoRALinear(nn.Linear(4, 4), rank=-1, alpha=1)
    with pytest.raises(ValueError, match="LoRA rank must be a positive int, got True"):
        apply_lora(TinyLM(), rank=True)
    with pytest.raises(TypeError, match="2-D weight"):
        LoRALinear(nn.ReLU(), rank=2, alpha=1)
    with pytest.raises(TypeError, match="quantize_base must be True or False, got 'no'"):
        apply_lora(TinyLM(), quantize_base="no")
    with pytest.raises(TypeError, match="double_quant must be True or False, got 0"):
        apply_lora(TinyLM(), double_quant=0)


def test_qlora_on_the_lab_llama():
    llama = pytest.importorskip("fsdp_lab.models.llama")
    data = pytest.importorskip("fsdp_lab.models.data")
    model = llama.Llama("cpu", seed=0)
    apply_lora(model, rank=8, alpha=16)
    counts = lora_parameter_counts(model)
    assert 0 < counts.trainable < counts.total / 10
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    cfg = model.config
    batch = data.synthetic_batch(cfg.vocab_size, 4, 32, seed=0, step=0)
    losses = []
    for _ in range(4):
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# -- QLoRA under PyTorch's own FSDP2 (torch.distributed.fsdp.fully_shard), 2 gloo ranks ------
# torch's fully_shard drives NF4Tensor's fsdp_pre/post_all_gather hooks: an independent check
# that the hooks meet PyTorch's contract. Weights (256 x 128) and (128 x 256) split into row
# chunks of 16,384 values: whole double-quantization groups, as torch's row chunking needs.
FSDP_STEPS = 5


def _fsdp_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    return apply_lora(model, target_modules=("0", "2"), rank=4, alpha=8)


def _fsdp_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 128, generator=g), torch.randn(8, 128, generator=g)


def _torch_fsdp2_worker(steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _fsdp_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local_weight = model[0].weight.to_local()
    expected_shard = _fsdp_model()[0].weight.fsdp_shard(rank, world_size)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _fsdp_batch(step)
        loss = F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "local_is_nf4": isinstance(local_weight, NF4Tensor),
        "packed_unchanged": torch.equal(model[0].weight.to_local().packed, expected_shard.packed),
        "lora": {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad},
        "losses": losses,
    }


@pytest.fixture(scope="module")
def torch_fsdp2_results():
    launch = pytest.importorskip("fsdp_lab.launch").launch
    return launch(_torch_fsdp2_worker, FSDP_STEPS, world_size=2, timeout=180)


def test_qlora_under_torch_fsdp2_matches_single_process(torch_fsdp2_reference, torch_fsdp2_results):
    reference = _fsdp_model()
    initial = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(FSDP_STEPS):
        x, y = _fsdp_batch(step)
        loss = F.mse_loss(reference(x), y)  # the full batch on one process
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for per_rank in torch_fsdp2_results:
        assert per_rank["local_is_nf4"] and per_rank["packed_unchanged"]
        assert set(per_rank["lora"]) == {"0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b"}
        for name, param in reference.named_parameters():
            if param.requires_grad:
                # Two half-batch gradients averaged differ from the full batch's in the last bits,
                # and Adam divides by sqrt(v): where a gradient is near zero those bits can move an
                # element by a sizeable part of lr (4.5e-5 seen on one CPU, 1e-6 on another). So
                # compare the whole tensor against the distance training moved it (about 1 here);
                # a rank stepping on its own half-batch gradient is off by about that distance.
                error = (per_rank["lora"][name] - param.detach()).norm()
                travelled = (param.detach() - initial[name]).norm()
                assert error <= 1e-3 * travelled, (name, error.item(), travelled.item())
    rank_means = [sum(r["losses"][s] for r in torch_fsdp2_results) / 2 for s in range(FSDP_STEPS)]
    assert rank_means == pytest.approx(losses, abs=1e-5)
