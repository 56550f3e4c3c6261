"""Gated-DeltaNet ops (dflash_kernels.gated_delta) against transformers' own Qwen3.5 functions.

Both backends (the pure-torch reference and the Triton kernels under the CPU
interpreter) are held to the oracle: transformers'
``torch_recurrent_gated_delta_rule`` and ``causal_conv1d_update`` run token by
token along each root -> node path, so every node's output and state (every
prefix of a chain) is checked, for chains (``parents=None``), random trees,
the trees DDTree builds, stars and explicit chains; odd node counts (1, 5,
17, 33), GQA ratios 1, 2, 3, odd head dims (24, 40: masked tiles, several
value blocks), fp32 and bf16 inputs. Then: replay equals the state at the
path's last node (entries past the count are garbage and never read; one
launch over layers), the conv window after a commit equals transformers'
conv state, the store modes, bad inputs, no host reads (meta tensors), the
torch.library registrations (opcheck) and the unspecialized counts.

Tolerances (``TOL``): every path computes in fp32 from the same inputs, so
states and fp32 outputs agree to fp32 rounding (summation order, ``exp`` /
``rsqrt`` implementations, ``q * Dk**-0.5`` against ``q / sqrt(Dk)``; about
3e-7 under the interpreter, the table leaves room for the GPU's approximate
``exp`` / ``rsqrt`` over 33 steps, far below what a wrong parent gives); bf16
outputs are rounded once to bf16 (a half ulp is 2**-9 relative). The conv
casts inputs to the weight's dtype and rounds its result there, as
transformers does, so bf16 convs may differ by one bf16 ulp of the result.
"""

import inspect
import math
import random

import pytest
import torch
import torch.nn.functional as F

import dflash_kernels as dk
import dflash_kernels._declare as declare_module
import dflash_kernels.gated_delta as gd_module
from dflash_kernels import force_backend
from dflash_kernels import reference as ref
from kernel_stub import KernelStub

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
HF_RULE = hf.torch_recurrent_gated_delta_rule
HF_CONV = getattr(hf, "causal_conv1d_update", None) or getattr(hf, "torch_causal_conv1d_update")

BACKENDS = ["reference", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: (atol, rtol) by dtype: outputs ("out"), fp32 states ("state"), conv results ("conv").
TOL = {
    torch.float32: {"out": (5e-5, 5e-5), "state": (5e-5, 5e-5), "conv": (1e-5, 1e-5)},
    torch.bfloat16: {"out": (1e-2, 1.6e-2), "state": (5e-5, 5e-5), "conv": (1e-2, 1.6e-2)},
}


def close(got, want, dtype, kind, msg=""):
    atol, rtol = TOL[dtype][kind]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=msg or None)


# ----------------------------------------------------------------------------- inputs and the oracle


def inputs(n, hk=2, group=2, dk_=24, dv=40, dtype=torch.float32, seed=0):
    """q, k [N, Hk, Dk], v [N, Hv, Dv], g fp32 / beta [N, Hv] as Qwen3.5 makes them, fp32 state [Hv, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    hv = hk * group
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rnd(n, hk, dk_), rnd(n, hk, dk_), rnd(n, hv, dv)
    a_log = torch.empty(hv).uniform_(math.log(0.5), math.log(4.0), generator=gen)
    g = -a_log.exp() * F.softplus(rnd(n, hv))  # fp32 log-decay, as the module computes it
    beta = torch.sigmoid(rnd(n, hv))
    state = rnd(hv, dk_, dv) * 0.5
    cast = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), g.to(DEVICE), cast(beta), state.to(DEVICE)


def path_to(parents, i):
    """Node indices from the root-level ancestor down to ``i`` (``parents`` a list, -1 = the committed state)."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def hf_along(q, k, v, g, beta, state, path):
    """transformers' recurrent rule over ``path`` (one call): outputs [len, Hv, Dv] and the final state."""
    group = v.shape[1] // q.shape[1]
    idx = torch.tensor(path, device=q.device)
    sel = lambda t: t.index_select(0, idx)[None]  # noqa: E731
    qq, kk = sel(q), sel(k)
    if group > 1:  # done here so that versions without the rule's own GQA expansion agree
        qq, kk = qq.repeat_interleave(group, dim=2), kk.repeat_interleave(group, dim=2)
    out, last = HF_RULE(qq, kk, sel(v), sel(g), sel(beta), initial_state=state[None].clone(),
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], last[0]


def hf_tree(q, k, v, g, beta, state, parents):
    """Per node: (output [Hv, Dv], state [Hv, Dk, Dv]) from transformers along its root -> node path."""
    par = list(range(-1, v.shape[0] - 1)) if parents is None else parents.tolist()
    outs, states = [], []
    for i in range(v.shape[0]):
        o, s = hf_along(q, k, v, g, beta, state, path_to(par, i))
        outs.append(o[-1])
        states.append(s)
    return torch.stack(outs), torch.stack(states)


def random_parents(n, seed, kind="random"):
    rng = random.Random(seed)
    if kind == "random":  # any parent in [-1, i)
        par = [rng.randint(-1, i - 1) for i in range(n)]
    elif kind == "deep":  # mostly i - 1, sometimes a jump back: reloads of old slices
        par = [i - 1 if rng.random() < 0.6 else rng.randint(-1, i - 1) for i in range(n)]
    elif kind == "star":  # every node a child of the committed state
        par = [-1] * n
    elif kind == "explicit_chain":
        par = list(range(-1, n - 1))
    else:
        raise ValueError(kind)
    return torch.tensor(par, dtype=torch.int64, device=DEVICE)


def run_tree(backend, q, k, v, g, beta, state, parents, **kw):
    n, hv, dv = v.shape
    scratch = torch.full((n, hv, q.shape[-1], dv), float("nan"), device=DEVICE)
    before = state.clone()
    with force_backend(backend):
        out = dk.gated_delta_tree(q, k, v, g, beta, state, parents, scratch=scratch, **kw)
    assert torch.equal(state, before), "the committed state must not be modified"
    assert out.dtype == v.dtype and out.shape == (n, hv, dv)
    return out, scratch


# ----------------------------------------------------------------------------- tree scan


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 5, 17, 33])
def test_chain_every_prefix_matches_transformers(backend, n):
    q, k, v, g, beta, state = inputs(n, hk=2, group=3, seed=n)
    out, scratch = run_tree(backend, q, k, v, g, beta, state, None)
    want_out, want_states = hf_tree(q, k, v, g, beta, state, None)
    close(out, want_out, torch.float32, "out")
    close(scratch, want_states, torch.float32, "state")
    # one call over the whole chain gives the same outputs (the prefix states above are its own)
    whole, last = hf_along(q, k, v, g, beta, state, list(range(n)))
    close(out, whole, torch.float32, "out")
    close(scratch[-1], last, torch.float32, "state")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,group,dims,kind", [
    (1, 1, (24, 40), "random"),
    (5, 2, (24, 40), "random"),
    (17, 3, (24, 40), "deep"),
    (33, 2, (16, 24), "random"),
    (17, 1, (40, 24), "star"),
    (17, 2, (24, 40), "explicit_chain"),
    (5, 2, (128, 128), "random"),  # Qwen3.5's head dims: the [128, 8] tile of the real launches
])
def test_tree_every_node_matches_transformers(backend, n, group, dims, kind):
    q, k, v, g, beta, state = inputs(n, hk=2, group=group, dk_=dims[0], dv=dims[1], seed=3 * n + group)
    parents = random_parents(n, seed=n + group, kind=kind)
    out, scratch = run_tree(backend, q, k, v, g, beta, state, parents, check=True)
    want_out, want_states = hf_tree(q, k, v, g, beta, state, parents)
    close(out, want_out, torch.float32, "out")
    close(scratch, want_states, torch.float32, "state")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_and_fp32_inputs(backend, dtype):
    n = 17
    q, k, v, g, beta, state = inputs(n, hk=1, group=3, dk_=24, dv=40, dtype=dtype, seed=11)
    parents = random_parents(n, seed=5, kind="deep")
    out, scratch = run_tree(backend, q, k, v, g, beta, state, parents)
    want_out, want_states = hf_tree(q, k, v, g, beta, state, parents)
    close(out, want_out, dtype, "out")
    close(scratch, want_states, dtype, "state")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddtree_parents_from_the_tree_builder(backend):
    """The parents array DDTree verifies ([root, nodes...], parents[0] = -1) is the op's input as it is."""
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 3, generator=gen), -1).sort(-1, descending=True).values
    _, _, parents, _ = dk.build_tree(logprobs, torch.arange(18).reshape(6, 3), 20)
    n = parents.numel()
    q, k, v, g, beta, state = inputs(n, hk=2, group=2, dk_=16, dv=24, seed=2)
    parents = parents.to(DEVICE)
    out, scratch = run_tree(backend, q, k, v, g, beta, state, parents)
    want_out, want_states = hf_tree(q, k, v, g, beta, state, parents)
    close(out, want_out, torch.float32, "out")
    close(scratch, want_states, torch.float32, "state")


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_scale_no_l2norm_int32_parents_strided_inputs(backend):
    n = 9
    q, k, v, g, beta, state = inputs(n, hk=2, group=2, dk_=16, dv=24, seed=4)
    parents = random_parents(n, seed=1).to(torch.int32)
    # q / k / v as views of one [N, C] buffer (the conv output), g / beta as column views
    big = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
    qv = big[:, :q[0].numel()].view(n, *q.shape[1:])
    kv_ = big[:, q[0].numel():2 * q[0].numel()].view(n, *k.shape[1:])
    vv = big[:, 2 * q[0].numel():].view(n, *v.shape[1:])
    gb = torch.stack([g, beta], dim=2)
    want = ref.gated_delta_tree(q, k, v, g, beta, state, parents, scale=0.3, qk_l2norm=False)
    with force_backend(backend):
        got = dk.gated_delta_tree(qv, kv_, vv, gb[..., 0], gb[..., 1], state, parents, scale=0.3, qk_l2norm=False)
    close(got, want, torch.float32, "out")
    # without the l2 norm the reference is the plain recurrence with q * 0.3: check one node by hand
    s = state.clone()
    for i in path_to(parents.tolist(), n - 1):
        kk = k[i].repeat_interleave(2, 0)
        s = s * g[i].exp()[:, None, None]
        delta = beta[i][:, None] * (v[i] - torch.einsum("hkv,hk->hv", s, kk))
        s = s + kk[:, :, None] * delta[:, None, :]
    close(got[n - 1], torch.einsum("hkv,hk->hv", s, 0.3 * q[n - 1].repeat_interleave(2, 0)), torch.float32, "out")


def test_store_branches_writes_only_reloaded_slices():
    """store_states="branches" (Triton): same outputs, only the slices a later node reloads are written."""
    n = 17
    q, k, v, g, beta, state = inputs(n, hk=2, group=2, dk_=16, dv=24, seed=8)
    parents = random_parents(n, seed=3, kind="deep")
    par = parents.tolist()
    reloaded = {p for i, p in enumerate(par) if p >= 0 and p != i - 1}
    out_all, scratch_all = run_tree("triton", q, k, v, g, beta, state, parents)
    out, scratch = run_tree("triton", q, k, v, g, beta, state, parents, store_states="branches")
    torch.testing.assert_close(out, out_all, atol=0, rtol=0)
    for i in range(n):
        if i in reloaded:
            torch.testing.assert_close(scratch[i], scratch_all[i], atol=0, rtol=0)
        else:
            assert torch.isnan(scratch[i]).all(), f"node {i} is never reloaded: its slice is not stored"
    # a chain stores nothing in that mode; without a scratch the outputs are the same
    _, chain_scratch = run_tree("triton", q, k, v, g, beta, state, None, store_states="branches")
    assert torch.isnan(chain_scratch).all()
    with force_backend("triton"):
        torch.testing.assert_close(dk.gated_delta_tree(q, k, v, g, beta, state, parents, store_states="branches"),
                                   out_all, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_tree(backend):
    q, k, v, g, beta, state = inputs(0)
    with force_backend(backend):
        out = dk.gated_delta_tree(q, k, v, g, beta, state, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert out.shape == (0, 4, 40)


# ----------------------------------------------------------------------------- replay


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_replay_equals_the_state_at_the_paths_last_node(backend, seed):
    n = 17
    q, k, v, g, beta, state = inputs(n, hk=2, group=3 if seed % 2 else 1, seed=20 + seed)
    parents = random_parents(n, seed=seed, kind="deep")
    _, want_states = hf_tree(q, k, v, g, beta, state, parents)
    node = random.Random(seed).randrange(n)
    path = path_to(parents.tolist(), node)
    a = 8  # fixed buffer, longer than some paths; entries past the count are garbage (never read)
    rows = torch.tensor((path + [10 ** 6, -7] * a)[:max(a, len(path))], device=DEVICE)
    st = state.clone()
    with force_backend(backend):
        dk.gated_delta_replay_(st, q, k, v, g, beta, rows, torch.tensor([len(path)], device=DEVICE))
    close(st, want_states[node], torch.float32, "state")


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_chain_prefix_and_zero_rows(backend):
    """The DFlash rollback: after accepting a drafts, replay rows 0..a from the pre-verify state."""
    n = 16
    q, k, v, g, beta, state = inputs(n, hk=2, group=2, dtype=torch.bfloat16, seed=3)
    _, want_states = hf_tree(q, k, v, g, beta, state, None)
    rows = torch.arange(n, device=DEVICE)
    for count in (0, 1, 7, n):
        st = state.clone()
        with force_backend(backend):
            dk.gated_delta_replay_(st, q, k, v, g, beta, rows, torch.tensor(count, device=DEVICE), check=True)
        want = state if count == 0 else want_states[count - 1]
        close(st, want, torch.bfloat16, "state", msg=f"count={count}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_batched_over_layers_in_place_views(backend):
    """[L] layers in one call, each with its own inputs; the states are views into a bigger buffer."""
    n_layers, n = 3, 9
    per_layer = [inputs(n, hk=2, group=2, dk_=16, dv=24, seed=40 + i) for i in range(n_layers)]
    q, k, v, g, beta, states = (torch.stack([p[j] for p in per_layer]) for j in range(6))
    buffer = torch.zeros(n_layers, 2, *states.shape[1:], device=DEVICE)
    buffer[:, 1] = states
    view = buffer[:, 1]  # [L, Hv, Dk, Dv], not contiguous
    rows = torch.tensor([0, 1, 3, 4, 8, 8], device=DEVICE)
    count = torch.tensor([5], device=DEVICE)
    with force_backend(backend):
        dk.gated_delta_replay_(view, q, k, v, g, beta, rows, count, check=True)
    for i in range(n_layers):
        _, want = hf_along(*per_layer[i], [0, 1, 3, 4, 8])
        close(buffer[i, 1], want, torch.float32, "state", msg=f"layer {i}")
    assert torch.equal(buffer[:, 0], torch.zeros_like(buffer[:, 0]))


# ----------------------------------------------------------------------------- conv


def hf_conv_path(x, window, weight, bias, activation, path):
    """transformers' causal_conv1d_update one token at a time along ``path``: (last output [C], conv state [C, K-1])."""
    params = inspect.signature(HF_CONV).parameters
    if "activation" not in params and activation is None:
        pytest.skip("this transformers' conv update always applies SiLU")
    conv_state = window.t()[None].clone()  # [1, C, K-1]
    for i in path:
        kwargs = {"activation": activation} if "activation" in params else {}
        y = HF_CONV(x[i][None, :, None], conv_state, weight, bias, **kwargs)
    return y[0, :, 0], conv_state[0]


CONV_CASES = [  # (n, channels, K, x dtype, weight dtype, bias, activation, parents kind)
    (1, 37, 4, torch.float32, torch.float32, True, "silu", "random"),
    (5, 37, 4, torch.float32, torch.float32, False, None, "random"),
    (17, 200, 4, torch.bfloat16, torch.bfloat16, True, "silu", "deep"),
    (33, 37, 2, torch.float32, torch.float32, True, "silu", "star"),
    (17, 37, 4, torch.bfloat16, torch.float32, False, "silu", "random"),
    (17, 37, 4, torch.float32, torch.bfloat16, True, "silu", "deep"),
    (9, 37, 4, torch.float32, torch.float32, True, "silu", None),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"N{c[0]}-C{c[1]}-K{c[2]}-{c[3]}-{c[4]}-{c[6]}-{c[7]}")
def test_conv_tree_matches_transformers_along_every_path(backend, case):
    n, channels, ksize, xdt, wdt, with_bias, act, kind = case
    gen = torch.Generator().manual_seed(n + channels)
    x = torch.randn(n, channels, generator=gen).to(DEVICE, xdt)
    window = torch.randn(ksize - 1, channels, generator=gen).to(DEVICE, xdt)
    weight = (torch.randn(channels, ksize, generator=gen) * 0.5).to(DEVICE, wdt)
    bias = torch.randn(channels, generator=gen).to(DEVICE, wdt) if with_bias else None
    parents = None if kind is None else random_parents(n, seed=n, kind=kind)
    par = list(range(-1, n - 1)) if parents is None else parents.tolist()
    with force_backend(backend):
        y = dk.causal_conv_tree(x, window, weight, parents, bias=bias, activation=act, check=True)
    assert y.dtype == xdt and y.shape == (n, channels)
    worst = torch.promote_types(xdt, wdt) if xdt == wdt else torch.bfloat16
    for i in range(n):
        want, _ = hf_conv_path(x, window, weight, bias, act, path_to(par, i))
        close(y[i], want, worst, "conv", msg=f"node {i}")


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_window_after_equals_transformers_conv_state(backend, batched):
    n, channels, ksize = 9, 12, 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, n, channels, generator=gen).to(DEVICE)
    window = torch.randn(2, ksize - 1, channels, generator=gen).to(DEVICE)
    weight = torch.randn(channels, ksize, generator=gen).to(DEVICE)
    path = [0, 2, 3, 7]
    rows = torch.tensor(path + [99, -1], device=DEVICE)
    for count in range(len(path) + 1):
        num = torch.tensor([count], device=DEVICE)
        with force_backend(backend):
            got = dk.conv_window_after(window if batched else window[0], x if batched else x[0], rows, num)
        for layer in range(2 if batched else 1):
            if count == 0:
                want = window[layer]
            else:
                _, state = hf_conv_path(x[layer], window[layer], weight, None, "silu", path[:count])
                want = state.t()
            torch.testing.assert_close(got[layer] if batched else got, want, atol=0, rtol=0)


def test_conv_window_after_kernel_size_one_and_long_paths():
    x = torch.arange(12.0).reshape(6, 2)
    rows, num = torch.tensor([0, 1, 2, 5]), torch.tensor([4])
    assert dk.conv_window_after(torch.empty(0, 2), x, rows, num).shape == (0, 2)
    got = dk.conv_window_after(torch.zeros(2, 2), x, rows, num)  # the path is longer than the window
    torch.testing.assert_close(got, x[[2, 5]])


# ----------------------------------------------------------------------------- batches


def batch_inputs(b, n, hk=1, group=3, dk_=24, dv=40, dtype=torch.float32):
    """``b`` sequences' inputs, stacked: q, k [b, N, Hk, Dk], v [b, N, Hv, Dv], g, beta [b, N, Hv], state [b, ...]."""
    per = [inputs(n, hk=hk, group=group, dk_=dk_, dv=dv, dtype=dtype, seed=70 + r) for r in range(b)]
    return tuple(torch.stack([p[j] for p in per]) for j in range(6))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("store", ["all", "branches", None])
def test_tree_batch_equals_each_sequence_alone(backend, b, store):
    """A batch of trees (each sequence its own parents and state; odd shapes: Hv = 3, Dk = 24, Dv = 40, N = 7)
    equals the reference run on each sequence alone; the batch of one equals the one-sequence call bit for bit."""
    n = 7
    q, k, v, g, beta, state = batch_inputs(b, n)
    kinds = ["deep", "star", "random"]
    parents = torch.stack([random_parents(n, seed=r, kind=kinds[r % 3]) for r in range(b)])
    scratch = None if store is None else torch.full((b, n + 2, 3, 24, 40), float("nan"), device=DEVICE)
    before = state.clone()
    with force_backend(backend):
        out = dk.gated_delta_tree(q, k, v, g, beta, state, parents, scratch=scratch, check=True,
                                  store_states=store or "all")
        chain = dk.gated_delta_tree(q, k, v, g, beta, state)
    assert torch.equal(state, before) and out.shape == (b, n, 3, 40)
    for r in range(b):
        want = ref.gated_delta_tree(q[r], k[r], v[r], g[r], beta[r], state[r], parents[r])
        close(out[r], want, torch.float32, "out", msg=f"sequence {r}")
        close(chain[r], ref.gated_delta_tree(q[r], k[r], v[r], g[r], beta[r], state[r]), torch.float32, "out")
        if store == "all":
            _, want_states = hf_tree(q[r], k[r], v[r], g[r], beta[r], state[r], parents[r])
            close(scratch[r, :n], want_states, torch.float32, "state", msg=f"sequence {r}")
    if b == 1:
        with force_backend(backend):
            alone = dk.gated_delta_tree(q[0], k[0], v[0], g[0], beta[0], state[0], parents[0])
        assert torch.equal(out[0], alone)


def _replay_batch_inputs(n_layers=2, b=3, n=9):
    per = [[inputs(n, hk=1, group=3, dk_=24, dv=40, seed=90 + 7 * i + r) for r in range(b)] for i in range(n_layers)]
    return tuple(torch.stack([torch.stack([per[i][r][j] for r in range(b)]) for i in range(n_layers)])
                 for j in range(6))  # [L, b, ...]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared_rows", [False, True])
def test_replay_batch_per_sequence_rows_and_counts(backend, shared_rows):
    """[L, b] states (a narrowed view of a wider buffer): sequence r replays its own rows[r, :num_rows[r]] (a count
    of 0 leaves it untouched); the buffer's other sequence is never written."""
    n_layers, b, n = 2, 3, 9
    q, k, v, g, beta, states = _replay_batch_inputs(n_layers, b, n)
    buffer = torch.full((n_layers, b + 1) + states.shape[2:], 7.0, device=DEVICE)
    buffer[:, :b] = states
    view = buffer[:, :b]
    if shared_rows:
        rows = torch.tensor([0, 2, 3, 8, 8], device=DEVICE)
        table = [rows.tolist()] * b
    else:
        table = [[0, 1, 2, 3, 4], [5, 6, 0, 0, 0], [8, 7, 1, 2, 6]]
        rows = torch.tensor(table, device=DEVICE)
    counts = [3, 0, 5]
    with force_backend(backend):
        dk.gated_delta_replay_(view, q, k, v, g, beta, rows, torch.tensor(counts, device=DEVICE), check=True)
    for i in range(n_layers):
        for r in range(b):
            if counts[r] == 0:
                assert torch.equal(buffer[i, r], states[i, r])
                continue
            _, want = hf_along(q[i, r], k[i, r], v[i, r], g[i, r], beta[i, r], states[i, r], table[r][: counts[r]])
            close(buffer[i, r], want, torch.float32, "state", msg=f"layer {i} sequence {r}")
    assert bool((buffer[:, b] == 7.0).all())


def test_replay_batch_of_one_equals_the_layers_form():
    """The batch of one is the same launch as the one-sequence (layers) form: equal bit for bit."""
    q, k, v, g, beta, states = _replay_batch_inputs(2, 1, 9)
    rows, num = torch.tensor([0, 1, 4, 8], device=DEVICE), torch.tensor([3], device=DEVICE)
    a, c = states.clone(), states[:, 0].clone()
    with force_backend("triton"):
        dk.gated_delta_replay_(a, q, k, v, g, beta, rows[None], num)
        dk.gated_delta_replay_(c, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], rows, num)
    assert torch.equal(a[:, 0], c)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 3])
def test_conv_tree_batch_equals_each_sequence_alone(backend, b):
    n, channels, ksize = 7, 37, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(b, n, channels, generator=gen).to(DEVICE)
    window = torch.randn(b, ksize - 1, channels, generator=gen).to(DEVICE)
    weight = (torch.randn(channels, ksize, generator=gen) * 0.5).to(DEVICE)
    bias = torch.randn(channels, generator=gen).to(DEVICE)
    kinds = ["random", "deep", "star"]
    parents = torch.stack([random_parents(n, seed=10 + r, kind=kinds[r % 3]) for r in range(b)])
    with force_backend(backend):
        y = dk.causal_conv_tree(x, window, weight, parents, bias=bias, check=True)
        y_chain = dk.causal_conv_tree(x, window, weight, None, bias=bias)
    assert y.shape == (b, n, channels)
    for r in range(b):
        close(y[r], ref.causal_conv_tree(x[r], window[r], weight, parents[r], bias=bias), torch.float32, "conv")
        close(y_chain[r], ref.causal_conv_tree(x[r], window[r], weight, None, bias=bias), torch.float32, "conv")
    if b == 1:
        with force_backend(backend):
            assert torch.equal(y[0], dk.causal_conv_tree(x[0], window[0], weight, parents[0], bias=bias))


@pytest.mark.parametrize("shared_rows", [False, True])
def test_conv_window_after_batch_per_sequence(shared_rows):
    n_layers, b, n, channels, ksize = 2, 3, 9, 5, 4
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n_layers, b, n, channels, generator=gen).to(DEVICE)
    window = torch.randn(n_layers, b, ksize - 1, channels, generator=gen).to(DEVICE)
    table = [[0, 2, 3, 7]] * b if shared_rows else [[0, 2, 3, 7], [8, 1, 0, 0], [4, 5, 6, 7]]
    rows = torch.tensor(table[0] if shared_rows else table, device=DEVICE)
    counts = [4, 0, 2]
    got = dk.conv_window_after(window, x, rows, torch.tensor(counts, device=DEVICE))
    assert got.shape == window.shape
    for i in range(n_layers):
        for r in range(b):
            want = dk.conv_window_after(window[i, r], x[i, r], torch.tensor(table[r], device=DEVICE),
                                        torch.tensor([counts[r]], device=DEVICE))
            assert torch.equal(got[i, r], want)


def test_batch_bad_inputs_give_clear_errors():
    q, k, v, g, beta, state = (t.cpu() for t in batch_inputs(2, 5))
    with pytest.raises(ValueError, match=r"parents must have shape \[2, 5\]"):
        dk.gated_delta_tree(q, k, v, g, beta, state, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"state must have shape \[2, 3, 24, 40\]"):
        dk.gated_delta_tree(q, k, v, g, beta, state[:1])
    with pytest.raises(ValueError, match=r"parents\[1, 3\] = 3 must be in \[-1, 3\)"):
        dk.gated_delta_tree(q, k, v, g, beta, state, torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 0, 3, 0]]), check=True)
    with pytest.raises(ValueError, match=r"scratch must be float32 \[2, >= 5, 3, 24, 40\]"):
        dk.gated_delta_tree(q, k, v, g, beta, state, scratch=torch.zeros(5, 3, 24, 40))
    L = lambda t: t[None]  # noqa: E731  (one layer of the batch)
    rows = torch.arange(5)
    with pytest.raises(ValueError, match=r"rows must be \[A\] \(every sequence's\) or \[b, A\] = \[2, A\]"):
        dk.gated_delta_replay_(L(state).clone(), L(q), L(k), L(v), L(g), L(beta), rows.expand(3, 5), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"num_rows must have shape \[2\] or \[1\] or \[\]"):
        dk.gated_delta_replay_(L(state).clone(), L(q), L(k), L(v), L(g), L(beta), rows, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"num_rows = 6 \(sequence 1\) must be in \[0, A\]"):
        dk.gated_delta_replay_(L(state).clone(), L(q), L(k), L(v), L(g), L(beta), rows, torch.tensor([1, 6]),
                               check=True)
    x, window, weight = torch.randn(2, 5, 8), torch.randn(2, 3, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"window must be \[b, K-1, C\] = \[2, 3, 8\]"):
        dk.causal_conv_tree(x, window[0], weight)
    with pytest.raises(ValueError, match=r"parents\[1, 2\] = 4"):
        dk.causal_conv_tree(x, window, weight, torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 4, 0, 0]]), check=True)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_give_clear_errors():
    q, k, v, g, beta, state = (t.cpu() for t in inputs(5))  # CPU tensors, like the other arguments here
    tree = dk.gated_delta_tree
    with pytest.raises(ValueError, match="k must have q's shape"):
        tree(q, k[:, :1], v, g, beta, state)
    with pytest.raises(ValueError, match="multiple of key heads"):
        tree(q, k, v[:, :3], g[:, :3], beta[:, :3], state[:3])
    with pytest.raises(ValueError, match=r"g must have shape \[5, 4\]"):
        tree(q, k, v, g[:4], beta, state)
    with pytest.raises(ValueError, match="state must be float32"):
        tree(q, k, v, g, beta, state.double())
    with pytest.raises(ValueError, match=r"state must have shape \[4, 24, 40\]"):
        tree(q, k, v, g, beta, state[:, :, :8])
    with pytest.raises(ValueError, match="parents must be int64 or int32"):
        tree(q, k, v, g, beta, state, torch.zeros(5))
    with pytest.raises(ValueError, match=r"parents must have shape \[5\]"):
        tree(q, k, v, g, beta, state, torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"parents\[2\] = 2 must be in \[-1, 2\)"):
        tree(q, k, v, g, beta, state, torch.tensor([-1, 0, 2, 1, 0]), check=True)
    with pytest.raises(ValueError, match=r"parents\[0\] = -2"):
        tree(q, k, v, g, beta, state, torch.tensor([-2, 0, 1, 1, 0]), check=True)
    with pytest.raises(ValueError, match="scratch must be float32"):
        tree(q, k, v, g, beta, state, scratch=torch.zeros(4, 4, 24, 40))
    with pytest.raises(ValueError, match="store_states must be one of"):
        tree(q, k, v, g, beta, state, store_states="some")
    with pytest.raises(TypeError, match="scale must be None or a float"):
        tree(q, k, v, g, beta, state, scale="0.1")
    with pytest.raises(ValueError, match="must be a floating-point tensor"):
        tree(q.long(), k, v, g, beta, state)

    replay = dk.gated_delta_replay_
    rows, num = torch.arange(5), torch.tensor([3])
    with pytest.raises(ValueError, match="rows must be 1-D"):
        replay(state.clone(), q, k, v, g, beta, rows[None], num)
    with pytest.raises(ValueError, match=r"num_rows must have shape \[1\] or \[\]"):
        replay(state.clone(), q, k, v, g, beta, rows, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"num_rows = 6 must be in \[0, A\] = \[0, 5\]"):
        replay(state.clone(), q, k, v, g, beta, rows, torch.tensor([6]), check=True)
    with pytest.raises(ValueError, match=r"rows\[1\] = 5 is not a row"):
        replay(state.clone(), q, k, v, g, beta, torch.tensor([0, 5]), torch.tensor([2]), check=True)
    with pytest.raises(ValueError, match=r"a leading layer dim L = 2"):
        replay(torch.stack([state, state]), q, k, v, g, beta, rows, num)
    with pytest.raises(ValueError, match=r"state must be \[Hv, Dk, Dv\] or \[L, Hv, Dk, Dv\]"):
        replay(state[0], q, k, v, g, beta, rows, num)

    x, window, weight = torch.randn(5, 8), torch.randn(3, 8), torch.randn(8, 4)
    conv = dk.causal_conv_tree
    with pytest.raises(ValueError, match=r"window must be \[K-1, C\] = \[3, 8\]"):
        conv(x, window[:2], weight)
    with pytest.raises(ValueError, match=r"weight must be \[C, K\]"):
        conv(x, window, weight[:4])
    with pytest.raises(ValueError, match="window must have x's dtype"):
        conv(x, window.double(), weight)
    with pytest.raises(ValueError, match="bias must be"):
        conv(x, window, weight, bias=torch.randn(8).double())
    with pytest.raises(ValueError, match="activation must be 'silu' or None"):
        conv(x, window, weight, activation="gelu")
    with pytest.raises(ValueError, match=r"parents\[3\] = 4"):
        conv(x, window, weight, torch.tensor([-1, 0, 1, 4, 0]), check=True)
    with pytest.raises(ValueError, match="disagree on C or L"):
        dk.conv_window_after(window, x[:, :4], rows, num)
    with pytest.raises(ValueError, match="x must have window's dtype"):
        dk.conv_window_after(window, x.double(), rows, num)


# ----------------------------------------------------------------------------- no host reads, recompiles


def test_no_host_read_without_check(monkeypatch):
    """On the meta device any host read of a value raises: the hot paths (check=False) read none.

    The Triton launchers run with their kernels stubbed; the references run as they are (they are the GPU
    fallback, so they must not sync either). check=True does read values, and fails there.
    """
    stubs = {name: KernelStub() for name in ("_gated_delta_tree_kernel", "_gated_delta_replay_kernel",
                                              "_causal_conv_tree_kernel")}
    for name, stub in stubs.items():
        monkeypatch.setattr(gd_module, name, stub)
    forced = {"backend": None}  # the dispatcher refuses 'triton' for meta tensors without the interpreter
    monkeypatch.setattr(declare_module, "resolve_backend", lambda backend, device: forced["backend"])
    meta = lambda *s, dtype=torch.float32: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    n, hk, hv, dk_, dv = 65, 16, 48, 128, 128
    q, k, v = meta(n, hk, dk_, dtype=torch.bfloat16), meta(n, hk, dk_, dtype=torch.bfloat16), meta(n, hv, dv)
    g, beta, state = meta(n, hv), meta(n, hv, dtype=torch.bfloat16), meta(hv, dk_, dv)
    parents, rows, count = meta(n, dtype=torch.int64), meta(16, dtype=torch.int64), meta(1, dtype=torch.int64)
    x, window, weight = meta(n, 10240, dtype=torch.bfloat16), meta(3, 10240, dtype=torch.bfloat16), meta(10240, 4)
    for backend in BACKENDS:
        forced["backend"] = backend
        for mode in ("all", "branches"):
            assert dk.gated_delta_tree(q, k, v, g, beta, state, parents, store_states=mode).shape == (n, hv, dv)
        dk.gated_delta_tree(q, k, v, g, beta, state, None)
        dk.gated_delta_replay_(state, q, k, v, g, beta, rows, count)
        dk.gated_delta_replay_(meta(3, hv, dk_, dv), *(t.expand(3, *t.shape) for t in (q, k, v, g, beta)),
                               rows, count)
        assert dk.causal_conv_tree(x.float(), window.float(), weight, parents).shape == (n, 10240)
        assert dk.conv_window_after(window, x, rows, count).shape == (3, 10240)
    assert len(stubs["_gated_delta_tree_kernel"].launches) == 3
    assert len(stubs["_gated_delta_replay_kernel"].launches) == 2
    assert len(stubs["_causal_conv_tree_kernel"].launches) == 1
    grid, _, kwargs = stubs["_gated_delta_replay_kernel"].launches[1]
    assert grid == (3, hv, dv // 8) and kwargs["BK"] == 128 and kwargs["num_warps"] == 1
    forced["backend"] = "triton"
    with pytest.raises((RuntimeError, NotImplementedError)):
        dk.gated_delta_replay_(state, q, k, v, g, beta, rows, count, check=True)


def test_counts_are_not_specialized():
    """The node and row counts vary per round: declared do_not_specialize (no recompiles)."""
    for kernel, names in ((gd_module._gated_delta_tree_kernel, {"n_nodes"}),
                          (gd_module._gated_delta_replay_kernel, {"n_rows"}),
                          (gd_module._causal_conv_tree_kernel, {"n_nodes"})):
        declared = getattr(kernel, "do_not_specialize", None)
        if declared is None:  # interpreter object
            declared = kernel.kwargs["do_not_specialize"]
        assert names <= {kernel.arg_names[i] if isinstance(i, int) else i for i in declared}


# ----------------------------------------------------------------------------- torch.library


def _op_cases():
    q, k, v, g, beta, state = inputs(6, hk=1, group=2, dk_=16, dv=24)
    parents = torch.tensor([-1, 0, 0, 1, -1, 4], device=DEVICE)
    rows, num = torch.tensor([0, 1, 3, 3], device=DEVICE), torch.tensor([3], device=DEVICE)
    x, window = torch.randn(6, 20, device=DEVICE), torch.randn(3, 20, device=DEVICE)
    weight, bias = torch.randn(20, 4, device=DEVICE), torch.randn(20, device=DEVICE)
    ops = torch.ops.dflash
    return [
        ("tree", ops.gated_delta_tree, (q, k, v, g, beta, state, parents, None), {}),
        ("tree_scratch", ops.gated_delta_tree, (q, k, v, g, beta, state, parents,
                                                torch.zeros(6, 2, 16, 24, device=DEVICE)), {"scale": 0.2}),
        ("chain", ops.gated_delta_tree, (q, k, v, g, beta, state, None, None), {"qk_l2norm": False}),
        ("replay", ops.gated_delta_replay_, (state.clone(), q, k, v, g, beta, rows, num), {}),
        ("conv", ops.causal_conv_tree, (x, window, weight, parents), {"bias": bias}),
        ("conv_chain", ops.causal_conv_tree, (x, window, weight, None), {"activation": None}),
        ("window", ops.conv_window_after, (window, x, rows, num), {}),
    ] + _batch_op_cases()


def _batch_op_cases():
    """The batched forms: 3 sequences, each its own tree, rows and count (one of them 0)."""
    q, k, v, g, beta, state = batch_inputs(3, 6, hk=1, group=2, dk_=16, dv=24)
    parents = torch.tensor([[-1, 0, 0, 1, -1, 4], [-1, 0, 1, 2, 3, 4], [-1, -1, 1, 0, 3, 3]], device=DEVICE)
    rows = torch.tensor([[0, 1, 3, 3], [5, 4, 0, 0], [0, 2, 5, 1]], device=DEVICE)
    num = torch.tensor([3, 0, 4], device=DEVICE)
    x, window = torch.randn(3, 6, 20, device=DEVICE), torch.randn(3, 3, 20, device=DEVICE)
    weight = torch.randn(20, 4, device=DEVICE)
    L = lambda t: t[None].contiguous()  # noqa: E731
    ops = torch.ops.dflash
    return [
        ("tree_batch", ops.gated_delta_tree, (q, k, v, g, beta, state, parents,
                                              torch.zeros(3, 6, 2, 16, 24, device=DEVICE)), {}),
        ("replay_batch", ops.gated_delta_replay_, (L(state), L(q), L(k), L(v), L(g), L(beta), rows, num), {}),
        ("conv_batch", ops.causal_conv_tree, (x, window, weight, parents), {}),
        ("window_batch", ops.conv_window_after, (L(window), L(x), rows, num), {}),
    ]


OP_CASES = _op_cases()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_opcheck(case, backend):
    _, op, args, kwargs = case
    clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    with force_backend(backend):
        torch.library.opcheck(op, tuple(clone(a) for a in args), {n: clone(t) for n, t in kwargs.items()})


def test_ops_equal_the_public_functions():
    for name, op, args, kwargs in OP_CASES:
        if name.startswith("replay"):
            a, b = args[0].clone(), args[0].clone()
            op(a, *args[1:], **kwargs)
            dk.gated_delta_replay_(b, *args[1:], **kwargs)
            torch.testing.assert_close(a, b, atol=0, rtol=0)
            continue
        if name.startswith("tree") or name == "chain":  # the op's 8th positional is the public scratch=
            a, b = [t.clone() if isinstance(t, torch.Tensor) else t for t in args], list(args)
            want = dk.gated_delta_tree(*b[:7], scratch=b[7].clone() if b[7] is not None else None, **kwargs)
            torch.testing.assert_close(op(*a, **kwargs), want, atol=0, rtol=0, msg=name)
            continue
        public = {"conv": dk.causal_conv_tree, "conv_chain": dk.causal_conv_tree, "conv_batch": dk.causal_conv_tree,
                  "window": dk.conv_window_after, "window_batch": dk.conv_window_after}[name]
        torch.testing.assert_close(op(*args, **kwargs), public(*args, **kwargs), atol=0, rtol=0, msg=name)
    schema = str(torch.ops.dflash.gated_delta_replay_.default._schema)
    assert "Tensor(a0!) state" in schema and schema.endswith("-> ()")
    # the mutated scratch is a required positional (torch < 2.13 fails on a mutated argument left at its default)
    assert "Tensor? parents, Tensor(a7!)? scratch, float? scale=None" in str(
        torch.ops.dflash.gated_delta_tree.default._schema)
