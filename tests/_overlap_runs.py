"""The runs shared by tests/test_compare.py and tests/test_prefetch.py: ONE launch of 2 ranks."""

import functools

# Llama "cpu" config (hand count): dim 128, 4 layers, 4 heads of 32, 2 kv heads, ffn_hidden 352, vocab 512.
DIM, LAYERS, KV_DIM, FFN, VOCAB = 128, 4, 64, 352, 512
LAYER_NUMEL = 2 * DIM * DIM + 2 * KV_DIM * DIM + 3 * DIM * FFN + 2 * DIM  # wq, wo; wk, wv; w1, w2, w3; 2 norms
ROOT_NUMEL = VOCAB * DIM + DIM + VOCAB * DIM  # tok_embeddings, norm, output (not tied)
FP32 = 4  # bytes; every dim is even, so world size 2 pads nothing

RUNS = [
    dict(name="block"),
    dict(name="block sync", synchronous=True),
    dict(name="two_blocks", wrapping="two_blocks"),
    dict(name="model", wrapping="model"),
    dict(name="explicit", prefetch="explicit"),
    dict(name="no prefetch", prefetch="none"),
    dict(name="no reshard", reshard_after_forward=False),
    dict(name="fsdp1 pre", implementation="fsdp1"),
    dict(name="fsdp1 post", implementation="fsdp1", prefetch="backward_post"),
    dict(name="fsdp1 none", implementation="fsdp1", prefetch="none"),
    dict(name="fsdp1 fwd", implementation="fsdp1", prefetch="none", forward_prefetch=True),
    dict(name="fsdp1 model", implementation="fsdp1", wrapping="model"),
    dict(name="fused", optimizer="fused"),
    dict(name="for_loop", optimizer="for_loop"),
    dict(name="offload two_blocks", wrapping="two_blocks", cpu_offload=True),
    dict(name="block again"),  # the first run once more, after every other model was built and dropped
]


@functools.lru_cache(maxsize=None)
def results():
    from fsdp_lab.compare import compare
    return compare(RUNS, steps=3, world_size=2, batch_size=4, seq_len=32, timeout=600)


def sequence(table, name, rank=0):
    """Rank's events in start order as short labels: 'AG layers.1', 'RS root', 'layers.1 backward'."""
    short = {"all_gather": "AG", "reduce_scatter": "RS"}
    return [f"{short.get(e.name, e.name)} {e.args.get('module')}" if e.kind == "comm" else e.name
            for e in table.timelines[name].events if e.rank == rank]
