"""torch.library registrations (dflash_kernels/ops.py, the one registration module): opcheck, equality with the public ops, fakes,
the cross-entropy backward, and graph-break-free torch.compile of the static-shape ops.

Every check runs on both backends: the reference, and Triton under the CPU interpreter (conftest.py sets
TRITON_INTERPRET=1 when there is no GPU). The compile smoke tests use the ``aot_eager`` backend: Dynamo,
the fakes and functionalization of the mutations run as under Inductor, without a C++ compile per graph.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import dflash_kernels as dk
from dflash_kernels import available_backends, force_backend

BACKENDS = available_backends(torch.device("cpu"))
OPS = torch.ops.dflash


def _draft(depth=3, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(depth, 16, generator=g), dim=-1).topk(k, dim=-1).values
    ids = torch.stack([torch.randperm(50, generator=g)[:k] for _ in range(depth)])
    return logprobs, ids


def _tree_inputs():
    """A device-built tree and a target choice that accepts a path of two nodes below the root."""
    logprobs, ids = _draft()
    token_ids, depths, parents, _ = dk.build_tree(logprobs, ids, 9, on_device=True)
    choice = torch.full((parents.numel(),), 49, dtype=torch.int64)
    first = 1  # node 1 is the best depth-1 child; accept it, then its best child if any
    choice[0] = token_ids[first - 1]
    kids = (parents[1:] == first).nonzero().flatten() + 1
    if kids.numel():
        choice[first] = token_ids[kids[0] - 1]
    return logprobs, ids, token_ids, depths, parents, choice


def _lm_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 16, generator=g).to(dtype)
    weight = (torch.randn(40, 16, generator=g) * 0.5).to(dtype)
    norm_weight = (torch.rand(16, generator=g) + 0.5).to(dtype)
    positions = torch.tensor([4, 1, 1, 3])
    return hidden, weight, norm_weight, positions


def _attention_inputs():
    g = torch.Generator().manual_seed(2)
    prefix, t = 3, 5
    query = torch.randn(4, t, 8, generator=g)
    cache = torch.randn(2, 2, 2, 12, 8, generator=g)  # [L, 2, Hkv, Smax, D]: K/V are strided views
    key, value = cache[1, 0, :, :prefix + t], cache[1, 1, :, :prefix + t]
    bits = dk.ancestor_bits(torch.tensor([-1, 0, 0, 1, 2]))
    positions = torch.tensor([3, 4, 4, 5, 5])
    sinks = torch.randn(4, generator=g)
    return query, key, value, bits, prefix, positions, sinks


def _static_attention_inputs():
    """The static form: the whole cache views [Hkv, Smax, D] (garbage past prefix + T) and a device prefix."""
    query, key, value, bits, prefix, positions, sinks = _attention_inputs()
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(2, 2, 2, 12, 8, generator=g)
    cache[:, :, :, :prefix + 5] = torch.stack([key, value])[None]
    cache[:, :, :, prefix + 5:] = 1e30  # never read
    return query, cache[1, 0], cache[1, 1], bits, torch.tensor([prefix]), positions, sinks


def _batched_attention_inputs():
    """A batch of 3 rows: K/V views ``kv[:, layer, 0/1]`` of a ``[b, L, 2, Hkv, Smax, D]`` cache, a tree and
    positions per row; the int form (K/V cut to prefix + T) and the static one (whole views, per-row prefixes
    [3, 0, 6], garbage past each row's prefix + T)."""
    g = torch.Generator().manual_seed(8)
    b, prefix, t = 3, 3, 5
    query = torch.randn(b, t, 4, 8, generator=g).transpose(1, 2)  # [b, Hq, T, D], a transposed view
    cache = torch.randn(b, 2, 2, 2, 12, 8, generator=g)
    prefixes = torch.tensor([3, 0, 6])
    for r, p in enumerate(prefixes.tolist()):
        cache[r, :, :, :, p + t:] = 1e30  # never read by the static form
    bits = torch.stack([dk.ancestor_bits(torch.tensor(p)) for p in
                        ([-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0])])
    positions = torch.tensor([[3, 4, 4, 5, 5], [3, 4, 5, 6, 7], [3, 4, 4, 4, 4]])
    static = (query, cache[:, 1, 0], cache[:, 1, 1], bits, prefixes, positions - 3 + prefixes[:, None])
    whole = (query, cache[:, 0, 0, :, :prefix + t], cache[:, 0, 1, :, :prefix + t], bits, prefix, positions)
    return whole, static


def _kv_inputs():
    kv = torch.randn(2, 2, 2, 10, 4, generator=torch.Generator().manual_seed(3))
    return kv, torch.tensor([3, 5, 6]), 3


def _batched_kv_inputs():
    """A batch of 3 caches [3, L, 2, Hkv, Smax, D], per-row sources [3, A], destinations and counts [3]
    (row 1 finished: count 0)."""
    kv = torch.randn(3, 2, 2, 2, 10, 4, generator=torch.Generator().manual_seed(9))
    return kv, torch.tensor([[3, 5, 6], [8, 9, 9], [1, 4, 9]]), torch.tensor([3, 8, 0]), torch.tensor([3, 0, 2])


def _kv_write_inputs(batch=None):
    """``(kv, layer, rows, key, value)`` of a one-sequence write (``batch=None``) or a batched one."""
    g = torch.Generator().manual_seed(8)
    lead = () if batch is None else (batch,)
    kv = torch.randn(*lead, 2, 2, 2, 10, 4, generator=g)
    rows = torch.tensor([7, 2, 5]) if batch is None else torch.stack([torch.randperm(10, generator=g)[:3]
                                                                      for _ in range(batch)])
    return kv, 1, rows, torch.randn(*lead, 2, 3, 4, generator=g), torch.randn(*lead, 2, 3, 4, generator=g)


def _kv_write_public(kv, layer, rows, key, value):
    dk.kv_write_(kv, layer, rows, key, value)
    return kv


def _dynamic_conv_module():
    """The module (the package attribute of that name is the op)."""
    import importlib

    return importlib.import_module("dflash_kernels.dynamic_conv")


def _dflash2_inputs():
    """DFlash2: x, a half of the projection output (a strided view), base, residual; selector inputs."""
    g = torch.Generator().manual_seed(7)
    x, residual = torch.randn(2, 5, 48, generator=g), torch.randn(2, 5, 48, generator=g)
    dyn = torch.randn(2, 5, 2, 3, 3, generator=g)[:, :, 1]
    base = torch.randn(3, 48, generator=g)
    unary = torch.randn(4, 3, generator=g)
    candidates = torch.randint(0, 30, (4, 3), generator=g)
    selector = (unary, candidates, torch.randn(4, 5, generator=g), torch.randn(30, 5, generator=g),
                torch.randn(30, 5, generator=g), torch.tensor([2]))
    return (x, dyn, base, residual), selector


def cases():
    """``(id, op, args, kwargs, public)``: ``public(*args, **kwargs)`` is the public call the op stands for."""
    g = torch.Generator().manual_seed(4)
    layers = [torch.randn(6, 8, generator=g) for _ in range(2)] + [torch.randn(6, 16, generator=g)[:, :8]]
    rows = torch.tensor([4, 0, 2])
    hidden, weight, norm_weight, positions = _lm_inputs()
    targets = torch.tensor([3, -100, 7, 39])
    loss_weights = torch.rand(4, generator=g)
    logprobs, ids, token_ids, depths, parents, choice = _tree_inputs()
    tree_bits = dk.ancestor_bits(parents)
    query, key, value, bits, prefix, att_pos, sinks = _attention_inputs()
    (b_query, b_key, b_value, b_bits, b_prefix, b_pos), batched_static = _batched_attention_inputs()
    kv, src, dst = _kv_inputs()
    b_kv, b_src, b_dst, b_count = _batched_kv_inputs()
    lm = dict(norm_weight=norm_weight, positions=positions)
    s_query, s_key, s_value, s_bits, s_prefix, s_pos, s_sinks = _static_attention_inputs()
    conv, sel = _dflash2_inputs()
    conv_grad = tuple(t.clone().requires_grad_(True) for t in conv)

    def walk_public(p, t, c):
        accepted, bonus = dk.walk_tree(p, t, c)
        return accepted, torch.tensor(bonus)

    return [
        ("gather_concat", OPS.gather_concat, (layers, rows), {}, lambda l, r: dk.gather_concat(l, r)),
        ("gather_concat_all_rows", OPS.gather_concat, (layers,), {}, lambda l: dk.gather_concat(l)),
        ("gather_concat_into", OPS.gather_concat.into, (layers, torch.empty(3, 24), rows), {},
         lambda l, out, r: dk.gather_concat(l, r, out=out)),
        ("lm_head_logits", OPS.lm_head_logits, (hidden, weight), dict(lm, softcap=5.0),
         lambda h, w, **kw: dk.lm_head_logits(h, w, **kw)),
        ("lm_head_logits_bf16", OPS.lm_head_logits, (hidden, weight), {"logit_dtype": torch.bfloat16},
         lambda h, w, **kw: dk.lm_head_logits(h, w, **kw)),
        ("lm_head_argmax", OPS.lm_head_argmax, (hidden, weight), lm,
         lambda h, w, **kw: dk.lm_head_argmax(h, w, **kw)),
        ("lm_head_topk", OPS.lm_head_topk, (hidden, weight, 3), lm,
         lambda h, w, k, **kw: dk.lm_head_topk(h, w, k, **kw)),
        ("lm_head_sample", OPS.lm_head_sample, (hidden, weight, 0.8, 1234), lm,
         lambda h, w, t, s, **kw: dk.lm_head_sample(h, w, t, seed=s, **kw)),
        ("lm_head_cross_entropy", OPS.lm_head_cross_entropy,
         (hidden.clone().requires_grad_(True), weight, targets, loss_weights), dict(lm, softcap=4.0),
         lambda h, w, t, lw, **kw: dk.lm_head_cross_entropy(h, w, t, weights=lw, **kw)),
        ("ancestor_bits", OPS.ancestor_bits, (parents,), {}, lambda p: dk.ancestor_bits(p)),
        ("ancestor_bits_nocheck", OPS.ancestor_bits, (parents,), {"check": False},
         lambda p, check: dk.ancestor_bits(p, check=check)),
        ("tree_positions", OPS.tree_positions, (depths, 10), {}, dk.tree_positions),
        ("build_tree", OPS.build_tree, (logprobs, ids, 9), {}, dk.build_tree),
        ("walk_tree", OPS.walk_tree, (parents, token_ids, choice), {}, walk_public),
        ("walk_tree_padded", OPS.walk_tree.padded, (parents, token_ids, choice, 3), {}, dk.walk_tree),
        ("walk_tree_padded_batched", OPS.walk_tree.padded,
         (parents.repeat(2, 1), token_ids.repeat(2, 1), torch.stack([choice, choice.flip(0)]), 4), {}, dk.walk_tree),
        ("build_tree_device", OPS.build_tree_device, (logprobs, ids, 9), {},
         lambda *a: dk.build_tree(*a, on_device=True)),
        ("walk_tree_device", OPS.walk_tree_device, (parents, token_ids, choice, 3), {},
         dk.walk_tree_device),
        ("walk_tree_device_bits", OPS.walk_tree_device, (parents, token_ids, choice, 3, tree_bits), {},
         dk.walk_tree_device),
        ("tree_attention", OPS.tree_attention, (query, key, value, bits, prefix), {},
         lambda *a: dk.tree_attention(*a)),
        ("tree_attention_chain", OPS.tree_attention, (query[None], key[None], value[None], None, prefix), {},
         lambda *a: dk.tree_attention(*a)),
        ("tree_attention_window", OPS.tree_attention, (query, key, value, bits, prefix, 0.3),
         dict(positions=att_pos, window=2, softcap=3.0, sinks=sinks),
         lambda *a, **kw: dk.tree_attention(*a, **kw)),
        ("tree_attention_batched", OPS.tree_attention, (b_query, b_key, b_value, b_bits, b_prefix), {},
         lambda *a: dk.tree_attention(*a)),
        ("tree_attention_batched_shared_window", OPS.tree_attention,
         (b_query, b_key, b_value, b_bits[0], b_prefix, 0.3), dict(positions=b_pos, window=2, softcap=3.0, sinks=sinks),
         lambda *a, **kw: dk.tree_attention(*a, **kw)),
        ("compact_kv_", OPS.compact_kv_, (kv, src, dst), {}, lambda *a: dk.compact_kv_(*a)),
        ("compact_kv_count", OPS.compact_kv_, (kv, src, dst, torch.tensor([2])), {},
         lambda kv_, s, d, n: dk.compact_kv_(kv_, s, d, num_rows=n)),
        ("kv_write_", OPS.kv_write_, _kv_write_inputs(), {}, _kv_write_public),
        ("kv_write_batched", OPS.kv_write_, _kv_write_inputs(batch=3), {}, _kv_write_public),
        # the tensor overloads: device prefix / seed / destination
        ("tree_attention_tensor", OPS.tree_attention.tensor, (s_query, s_key, s_value, s_bits, s_prefix), {},
         lambda *a: dk.tree_attention(*a)),
        ("tree_attention_tensor_chain", OPS.tree_attention.tensor,
         (s_query[None], s_key[None], s_value[None], None, s_prefix.reshape(())), {}, lambda *a: dk.tree_attention(*a)),
        ("tree_attention_tensor_window", OPS.tree_attention.tensor, (s_query, s_key, s_value, s_bits, s_prefix, 0.3),
         dict(positions=s_pos, window=2, softcap=3.0, sinks=s_sinks), lambda *a, **kw: dk.tree_attention(*a, **kw)),
        ("tree_attention_tensor_batched", OPS.tree_attention.tensor, batched_static[:5], {},
         lambda *a: dk.tree_attention(*a)),
        ("tree_attention_tensor_batched_window", OPS.tree_attention.tensor, batched_static[:5] + (0.3,),
         dict(positions=batched_static[5], window=2, softcap=3.0, sinks=s_sinks),
         lambda *a, **kw: dk.tree_attention(*a, **kw)),
        ("tree_attention_tensor_batched_chain", OPS.tree_attention.tensor,
         batched_static[:3] + (None, batched_static[4].int()), dict(window=3), lambda *a, **kw: dk.tree_attention(*a, **kw)),
        ("lm_head_sample_tensor", OPS.lm_head_sample.tensor, (hidden, weight, 0.8, torch.tensor([1234])),
         dict(lm, softcap=5.0), lambda h, w, t, s, **kw: dk.lm_head_sample(h, w, t, seed=s, **kw)),
        ("lm_head_sample_processed", OPS.lm_head_sample_processed,
         (hidden, weight, 0.8, 5, 0.9, 0.05, torch.tensor([7])), lm,
         lambda h, w, t, k, p, m, s, **kw: dk.lm_head_sample(h, w, t, top_k=k, top_p=p, min_p=m, seed=s, **kw)),
        ("lm_head_sample_processed_bf16", OPS.lm_head_sample_processed,
         (hidden.bfloat16(), weight.bfloat16(), 1.1, None, 0.8, None, torch.tensor([8])), {},
         lambda h, w, t, k, p, m, s: dk.lm_head_sample(h, w, t, top_k=k, top_p=p, min_p=m, seed=s)),
        ("rejection_sample", OPS.rejection_sample,
         (hidden, weight, torch.tensor([3, 9, 9, 1]), 0.8, 6, 0.9, None, torch.tensor([11]), hidden[1:] * 0.5),
         dict(norm_weight=norm_weight),
         lambda h, w, x, t, k, p, m, s, qh, **kw: dk.rejection_sample(h, w, x, t, top_k=k, top_p=p, min_p=m, seed=s,
                                                                       q_hidden=qh, **kw)),
        ("rejection_sample_sparse", OPS.rejection_sample,
         (hidden, weight, torch.tensor([3, 9, 9, 1]), 1.1, None, None, 0.05, torch.tensor([12]), None,
          torch.tensor([[3, 4], [9, 0], [2, 9], [1, 39]]), torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.2, 0.8], [1, 0.]])),
         {}, lambda h, w, x, t, k, p, m, s, qh, qi, qp: dk.rejection_sample(h, w, x, t, top_k=k, top_p=p, min_p=m,
                                                                              seed=s, q_ids=qi, q_probs=qp)),
        ("compact_kv_tensor", OPS.compact_kv_.tensor, (kv, src, torch.tensor([dst]), torch.tensor([2])), {},
         lambda kv_, s, d, n: dk.compact_kv_(kv_, s, d, num_rows=n)),
        ("compact_kv_batched", OPS.compact_kv_.tensor, (b_kv, b_src, b_dst, b_count), {},
         lambda kv_, s, d, n: dk.compact_kv_(kv_, s, d, num_rows=n)),
        ("compact_kv_batched_all_rows", OPS.compact_kv_.tensor, (b_kv[[0, 2]], b_src[[0, 2]], b_dst[[0, 2]], None),
         {}, lambda kv_, s, d, n: dk.compact_kv_(kv_, s, d, num_rows=n)),
        ("dynamic_conv", OPS.dynamic_conv, conv[:3], {}, lambda *a: dk.dynamic_conv(*a)),
        ("dynamic_conv_residual_grad", OPS.dynamic_conv, conv_grad, {}, lambda *a: dk.dynamic_conv(*a)),
        ("dynamic_conv_backward", OPS.dynamic_conv_backward, (conv[3],) + conv[:3], {},
         lambda g, x, d, b: _dynamic_conv_module().dynamic_conv_backward(g, x, d, b)[:3]),
        ("select_candidates", OPS.select_candidates, sel + (0.0,), {}, lambda *a: dk.select_candidates(*a)),
        ("select_candidates_sample", OPS.select_candidates, sel + (0.8, torch.tensor([5])), {},
         lambda *a: dk.select_candidates(*a)),
        ("build_selector_tree_device", OPS.build_selector_tree_device,
         (dk.selector_child_logprobs(*sel), sel[1], 7), {}, lambda *a: dk.build_selector_tree_device(*a)),
    ]


CASES = cases()
IDS = [c[0] for c in CASES]


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(y) for y in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


#: The registered op of every public op (``torch.ops.dflash.<name>``), with its overloads.
REGISTERED = {"gather_concat": {"default", "into"}, "lm_head_logits": {"default"}, "lm_head_argmax": {"default"},
              "lm_head_topk": {"default"}, "lm_head_sample": {"default", "tensor"},
              "lm_head_sample_processed": {"default"}, "lm_head_cross_entropy": {"default"},
              "lm_head_cross_entropy_backward": {"default"}, "ancestor_bits": {"default"},
              "tree_positions": {"default"}, "build_tree": {"default"}, "walk_tree": {"default", "padded"},
              "build_tree_device": {"default", "tables"}, "walk_tree_device": {"default"},
              "tree_attention": {"default", "tensor"}, "compact_kv_": {"default", "tensor"},
              "kv_write_": {"default"}, "gated_delta_tree": {"default"}, "gated_delta_replay_": {"default"},
              "causal_conv_tree": {"default"}, "conv_window_after": {"default"}, "dynamic_conv": {"default"},
              "dynamic_conv_backward": {"default"}, "select_candidates": {"default"},
              "build_selector_tree_device": {"default"}, "rejection_sample": {"default"}}


def test_every_public_op_is_registered():
    for name, overloads in REGISTERED.items():
        assert hasattr(OPS, name), name
        assert set(getattr(OPS, name).overloads()) == overloads, name
    # the static aliases are gone: one name per op
    for old in ("tree_attention_static", "lm_head_sample_static", "lm_head_sample_processed_static",
                "compact_kv_static_", "build_tree_device_static", "gather_concat_out", "tree_attention_mask"):
        assert not hasattr(dk, old) and old not in dir(OPS), old
    # mutating ops return nothing: the one form every supported torch registers (no Tag.inplace / Tag.out,
    # no keyword-only tensors before torch 2.13)
    for op in (OPS.compact_kv_.default, OPS.compact_kv_.tensor, OPS.kv_write_.default):
        schema = str(op._schema)
        assert ("Tensor(a0!) kv" in schema or "Tensor(a!) kv" in schema) and schema.endswith("-> ()"), schema
    assert str(OPS.gated_delta_replay_.default._schema).endswith("-> ()")
    # the per-round values of the tensor overloads are tensors (a compiled step never specializes on them)
    assert "Tensor prefix_len" in str(OPS.tree_attention.tensor._schema)
    assert "SymInt prefix_len" in str(OPS.tree_attention.default._schema)
    assert "Tensor seed" in str(OPS.lm_head_sample.tensor._schema)
    assert "SymInt seed" in str(OPS.lm_head_sample.default._schema)
    assert "Tensor seed" in str(OPS.lm_head_sample_processed.default._schema)
    assert "Tensor dst_start" in str(OPS.compact_kv_.tensor._schema)
    assert "SymInt dst_start" in str(OPS.compact_kv_.default._schema)
    assert "Tensor(a1!) out, Tensor? rows=None, bool check_bounds=True) -> ()" in str(
        OPS.gather_concat.into._schema)
    assert "Tensor[] layers" in str(OPS.gather_concat.default._schema)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck(case, backend):
    _, op, args, kwargs, _ = case
    if isinstance(op, torch._ops.OpOverloadPacket):  # opcheck takes one overload
        op = op.default
    with force_backend(backend):
        torch.library.opcheck(op, _clone(args), _clone(kwargs))


#: The cases whose op mutates an argument and returns nothing: the index of that argument.
MUTATED_ARG = {"gather_concat_into": 1, "compact_kv_": 0, "compact_kv_count": 0, "compact_kv_tensor": 0,
               "kv_write_": 0, "kv_write_batched": 0, "compact_kv_batched": 0, "compact_kv_batched_all_rows": 0}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_equals_public_and_fake_shapes(case, backend):
    name, op, args, kwargs, public = case
    with force_backend(backend):
        got_args, got_kwargs = _clone(args), _clone(kwargs)
        returned = op(*got_args, **got_kwargs)
        if name in MUTATED_ARG:  # a mutating op returns nothing; its result is the buffer it wrote
            assert returned is None, name
            returned = got_args[MUTATED_ARG[name]]
        got = _flat(returned)
        want_args, want_kwargs = _clone(args), _clone(kwargs)
        want = _flat(public(*want_args, **want_kwargs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device, name
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)
    for g, w in zip(_flat(got_args) + list(got_kwargs.values()), _flat(want_args) + list(want_kwargs.values())):
        if isinstance(g, torch.Tensor):  # mutated inputs (kv, out) end equal too
            torch.testing.assert_close(g, w, rtol=0, atol=0)

    real_args, real_kwargs = _clone(args), _clone(kwargs)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    to_fake = lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    fake_args = [[to_fake(y) for y in a] if isinstance(a, list) else to_fake(a) for a in real_args]
    fake_kwargs = {k: to_fake(v) for k, v in real_kwargs.items()}
    with mode:
        fake_returned = op(*fake_args, **fake_kwargs)
    if name in MUTATED_ARG:
        assert fake_returned is None, name
        fake_returned = fake_args[MUTATED_ARG[name]]
    fake = _flat(fake_returned)
    for f, g in zip(fake, got):
        assert f.dtype == g.dtype and f.device == g.device, name
        if name == "walk_tree" and f.dim() == 1:  # the accepted path's length is data-dependent
            assert isinstance(f.shape[0], torch.SymInt)
            continue
        assert tuple(f.shape) == tuple(g.shape), name


def test_build_tree_size_is_static():
    """The C++ heap always reaches tree_size(D, K, budget) nodes, even with -inf log-probs and at K = 1."""
    for depth, k, budget in ((3, 4, 9), (2, 2, 50), (4, 1, 3), (1, 3, 0), (3, 3, 39)):
        logprobs, ids = _draft(depth, k, seed=depth * 10 + k)
        logprobs[:, 1:] = float("-inf")
        token_ids, depths, parents, _ = OPS.build_tree(logprobs, ids, budget)
        n = dk.tree_size(depth, k, budget)
        assert token_ids.shape == (n,) and depths.shape == (n,) and parents.shape == (n + 1,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["plain", "norm_positions", "softcap_weights_bf16"])
def test_cross_entropy_gradient_matches_public(variant, backend):
    hidden, weight, norm_weight, positions = _lm_inputs(torch.bfloat16 if "bf16" in variant else torch.float32)
    n = hidden.shape[0]
    kw = {}
    targets = torch.tensor([3, -100, 7, 39, 0])
    if variant != "plain":
        kw = dict(norm_weight=norm_weight, positions=positions)
        targets = targets[:4]
    if "softcap" in variant:
        kw["softcap"] = 4.0
        kw["weights"] = torch.rand(targets.numel())
    grad_out = torch.randn(targets.numel())
    with force_backend(backend):
        h_op = hidden.clone().requires_grad_(True)
        loss_op = OPS.lm_head_cross_entropy(h_op, weight, targets, **kw)
        (grad_op,) = torch.autograd.grad(loss_op, h_op, grad_out)
        h_pub = hidden.clone().requires_grad_(True)
        loss_pub = dk.lm_head_cross_entropy(h_pub, weight, targets, **kw)
        (grad_pub,) = torch.autograd.grad(loss_pub, h_pub, grad_out)
    assert grad_op.shape == (n, 16) and grad_op.dtype == hidden.dtype
    torch.testing.assert_close(loss_op, loss_pub)
    tol = dict(rtol=2e-2, atol=2e-2) if hidden.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_op.float(), grad_pub.float(), **tol)
    if variant == "norm_positions":  # row 1 is selected twice, rows 0 and 2 never
        assert grad_op[0].abs().sum() == 0 and grad_op[2].abs().sum() == 0 and grad_op[1].abs().sum() > 0


# --------------------------------------------------------------------------- torch.compile


def _compiled_breaks(fn, *args):
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    return out, sum(counters["graph_break"].values())


def _gather_step(layers, rows, out):
    OPS.gather_concat.into(layers, out[1:], rows, False)
    return OPS.gather_concat(layers, rows, False) * 2


def _argmax_step(hidden, weight, norm_weight, positions):
    return OPS.lm_head_argmax(hidden + 1, weight, norm_weight, positions, 1e-6, False) + 1


def _attention_step(query, key, value, bits, prefix):
    return OPS.tree_attention(query * 0.5, key, value, bits, prefix).sum(0)


def _compact_step(kv, src, dst):
    OPS.compact_kv_(kv, src, dst, None, False)
    return kv[:, :, :, :dst + src.numel()].sum()


def _static_step(query, key, value, bits, prefix, hidden, weight, seed, kv, src, dst, count):
    """One static round's kernel ops: attention at a device prefix, a seeded sample, a device-destination compaction."""
    out = OPS.tree_attention.tensor(query, key, value, bits, prefix, None, None, None, None, None)
    tokens = OPS.lm_head_sample.tensor(hidden, weight, 0.7, seed + 1, None, None, 1e-6, None, None)
    OPS.compact_kv_.tensor(kv, src, dst, count)
    return out.sum(0), tokens, kv.sum()


def _public_step(query, key, value, bits, prefix, hidden, weight, seed, kv, src, dst, count):
    """The same round through the public ops (a tensor where the round needs one): traced without a break,
    the Triton path through the registered ops, the reference inlined."""
    out = dk.tree_attention(query, key, value, bits, prefix)
    tokens = dk.lm_head_sample(hidden, weight, 0.7, seed=seed + 1, check_bounds=False)
    dk.compact_kv_(kv, src, dst, num_rows=count, check=False)
    return out.sum(0), tokens, kv.sum()


def _batched_commit_step(kv, src, dst, count):
    """A batch's DDTree commit: every row's accepted rows moved by one op, the row lengths advanced."""
    dk.compact_kv_(kv, src, dst, num_rows=count, check=False)
    return kv.sum(), dst + count


def _dflash2_step(x, dyn, base, residual, unary, candidates, projected, pred, succ, anchor, seed):
    """A DFlash2 layer's two convs (the second with the residual) and the selector's seeded chain, through
    the public ops."""
    y = dk.dynamic_conv(x, dyn, base)
    out = dk.dynamic_conv(y * 2, dyn, base, residual)
    tokens, index, q = dk.select_candidates(unary, candidates, projected, pred, succ, anchor, 0.7, seed + 1)
    return out.sum(0), tokens, index, q


def _rejection_step(hidden, weight, norm_weight, proposals, q_hidden, q_ids, q_probs, seed):
    """A chain's rejection sampling with a dense and a sparse draft, seeded on the device, no host read."""
    kw = dict(top_k=7, top_p=0.9, norm_weight=norm_weight, check_bounds=False)
    dense = dk.rejection_sample(hidden, weight, proposals, 0.8, q_hidden=q_hidden, seed=seed + 1, **kw)
    sparse = dk.rejection_sample(hidden, weight, proposals, 0.8, q_ids=q_ids, q_probs=q_probs, seed=seed + 2, **kw)
    return dense + sparse


def _tree_step(logprobs, ids, choice):
    token_ids, depths, parents, _ = OPS.build_tree_device(logprobs, ids, 9)
    bits = OPS.ancestor_bits(parents, False)
    path, path_len, committed = OPS.walk_tree_device(parents, token_ids, choice, logprobs.shape[0], bits)
    return path, path_len, committed, OPS.tree_positions(depths, 7)


def _compile_cases():
    g = torch.Generator().manual_seed(5)
    layers = [torch.randn(6, 8, generator=g) for _ in range(3)]
    hidden, weight, norm_weight, positions = _lm_inputs()
    query, key, value, bits, prefix, _, _ = _attention_inputs()
    logprobs, ids, _, _, _, choice = _tree_inputs()
    return [
        ("gather", _gather_step, (layers, torch.tensor([5, 1]), torch.zeros(3, 24))),
        ("lm_head_argmax", _argmax_step, (hidden, weight, norm_weight, positions)),
        ("tree_attention", _attention_step, (query, key, value, bits, prefix)),
        ("compact_kv_", _compact_step, _kv_inputs()),
        ("static_step", _static_step, _static_attention_inputs()[:5] + (hidden, weight, torch.tensor([3]))
         + (_kv_inputs()[0], _kv_inputs()[1], torch.tensor([3]), torch.tensor([2]))),
        ("public_step", _public_step, _static_attention_inputs()[:5] + (hidden, weight, torch.tensor([3]))
         + (_kv_inputs()[0], _kv_inputs()[1], torch.tensor([3]), torch.tensor([2]))),
        ("compact_kv_batched", _batched_commit_step, _batched_kv_inputs()),
        ("build_tree_device", _tree_step, (logprobs, ids, choice)),
        ("rejection_sample", _rejection_step, (hidden, weight, norm_weight, torch.tensor([3, 9, 9, 1]), hidden[1:] * 0.5,
                                               torch.tensor([[3, 4], [9, 0], [2, 9], [1, 39]]),
                                               torch.full((4, 2), 0.5), torch.tensor([3]))),
        ("dflash2", _dflash2_step, _dflash2_inputs()[0] + _dflash2_inputs()[1] + (torch.tensor([4]),)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _compile_cases(), ids=lambda c: c[0])
def test_compile_fullgraph_no_graph_breaks(case, backend):
    name, fn, args = case
    with force_backend(backend):
        eager_args = _clone(args)
        want = _flat(fn(*eager_args))
        compiled_args = _clone(args)
        got, breaks = _compiled_breaks(fn, *compiled_args)
    assert breaks == 0, dict(counters["graph_break"])
    for g, w in zip(_flat(got), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)
    for g, w in zip(_flat(compiled_args), _flat(eager_args)):  # the mutations happened in place
        if isinstance(g, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_explain_counts_one_graph():
    """torch._dynamo.explain sees the tree round's four ops as one graph, no break."""
    logprobs, ids, _, _, _, choice = _tree_inputs()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_tree_step)(logprobs, ids, choice)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    targets = {str(node.target) for gm in explanation.graphs for node in gm.graph.nodes}
    for op in ("build_tree_device", "ancestor_bits", "walk_tree_device", "tree_positions"):
        assert f"dflash.{op}" in targets


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_cross_entropy_backward(backend):
    """The backward op on its own (the forward's opcheck reaches it through autograd)."""
    hidden, weight, norm_weight, positions = _lm_inputs()
    args = (torch.randn(4), hidden, weight, torch.tensor([3, -100, 7, 39]), torch.rand(4), norm_weight, positions)
    with force_backend(backend):
        torch.library.opcheck(OPS.lm_head_cross_entropy_backward, args, {"softcap": 4.0})


def test_shape_rule_binds_the_call_by_name():
    """A declared op's fake is its shape rule applied to the call bound to the op's signature: positional or
    keyword, defaults applied, and the fake carries that signature."""
    import inspect

    from dflash_kernels._declare import shape_rule

    def op(x: torch.Tensor, k: int, rows=None, scale: float = 2.0) -> torch.Tensor:
        raise AssertionError("only the fake runs")

    seen = []
    fake = shape_rule(inspect.signature(op), lambda a: seen.append(vars(a)) or a.x.new_empty(a.k))
    x = torch.zeros(3)
    assert fake(x, 5).shape == (5,) and fake(x, k=2, scale=1.0).shape == (2,)
    assert seen == [{"x": x, "k": 5, "rows": None, "scale": 2.0}, {"x": x, "k": 2, "rows": None, "scale": 1.0}]
    assert inspect.signature(fake) == inspect.signature(op)
    with pytest.raises(TypeError):
        fake(x)  # a call the op's signature does not bind
