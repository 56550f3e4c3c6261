"""The DFlash2 candidate selector's chain: the reference against a position-by-position loop, the Triton
kernel (the CPU interpreter; compiled on a GPU) against the reference, seeded sampling, input errors."""

import types

import pytest
import torch

import dflash_kernels as dk
from dflash.drafter.dflash2 import CandidateSelector, select_reference
from dflash_kernels import force_backend, reference as R

#: where the kernel comparisons run: CUDA when present (compiled kernels with DFLASH_TEST_REAL_TRITON=1),
#: else the CPU (the interpreter)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = "triton" in dk.available_backends(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs a GPU or TRITON_INTERPRET=1")

#: q of the fast path vs the reference (both fp32; the dot products summed in another order)
Q_TOL = dict(rtol=1e-5, atol=1e-6)

#: (S or None, D, k, r, V): k in {1, 3, 16}, odd ranks (67 takes two rank chunks of the kernel)
SHAPES = [(None, 4, 3, 5, 40), (None, 15, 16, 67, 300), (3, 6, 1, 7, 50), (2, 1, 16, 33, 64)]


def _inputs(S, D, k, r, V, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lead = (D,) if S is None else (S, D)
    unary = torch.randn(*lead, k, generator=g)
    candidates = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(int(torch.tensor(lead).prod()))])
    projected = torch.randn(*lead, r, generator=g).to(dtype)
    predecessor = torch.randn(V, r, generator=g).to(dtype)
    successor = torch.randn(V, r, generator=g).to(dtype)
    anchor = torch.randint(0, V, (1 if S is None else S,), generator=g)
    return tuple(t.to(device) for t in (unary, candidates.view(*lead, k), projected, predecessor, successor, anchor))


def _loop_greedy(unary, candidates, projected, predecessor, successor, anchor):
    """Greedy chain of one sequence, one position at a time, scores in fp64."""
    prev, tokens = int(anchor.reshape(-1)[0]), []
    for j in range(unary.shape[0]):
        ctx = predecessor[prev].double() * projected[j].double()
        scores = [float(unary[j, i]) + float(successor[candidates[j, i]].double() @ ctx)
                  for i in range(unary.shape[1])]
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        prev = int(candidates[j, best])
        tokens.append(prev)
    return torch.tensor(tokens)


def test_reference_greedy_is_the_loop():
    args = _inputs(None, 15, 16, 67, 300)
    tokens, index, q = R.select_candidates(*args)
    assert torch.equal(tokens, _loop_greedy(*args))
    assert torch.equal(tokens, args[1].gather(1, index[:, None])[:, 0])
    torch.testing.assert_close(q.sum(-1), torch.ones(15))
    # select_reference (the drafter module's name) is the same chain
    for got, want in zip(select_reference(*args), (tokens, index, q)):
        assert torch.equal(got, want)


def test_greedy_ties_take_the_lowest_slot():
    unary = torch.zeros(3, 4)
    candidates = torch.tensor([[5, 6, 7, 8]] * 3)
    zeros = torch.zeros(10, 2)
    backends = dk.available_backends(torch.device("cpu"))
    for backend in backends:
        tokens, index, q = dk.select_candidates(unary, candidates, torch.ones(3, 2), zeros, zeros,
                                                torch.tensor([1]), backend=backend)
        assert index.tolist() == [0, 0, 0] and tokens.tolist() == [5, 5, 5], backend
        torch.testing.assert_close(q, torch.full((3, 4), 0.25))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"S{s[0]}-D{s[1]}-k{s[2]}-r{s[3]}" for s in SHAPES])
def test_triton_matches_reference(shape, dtype):
    args = _inputs(*shape, dtype=dtype, seed=1, device=DEVICE)
    if dtype == torch.bfloat16:
        args = (args[0].bfloat16(),) + args[1:]  # model-dtype unary scores too
    seed = torch.tensor([2024], device=DEVICE)
    for temperature in (0.0, 0.7):
        got = dk.select_candidates(*args, temperature, seed, backend="triton")
        want = R.select_candidates(*args, temperature, seed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), temperature
        assert got[2].dtype == torch.float32 and got[2].shape == args[0].shape
        torch.testing.assert_close(got[2], want[2], **Q_TOL)
    if shape[0] is None:  # the greedy chain equals the drafter's select_reference and the plain loop
        got = dk.select_candidates(*args, backend="triton")
        assert torch.equal(got[0], select_reference(*args)[0])
        assert torch.equal(got[0].cpu(), _loop_greedy(*(t.cpu() for t in args)))


@pytest.mark.parametrize("backend", dk.available_backends(torch.device(DEVICE)))
def test_sampling_is_a_function_of_the_seed(backend):
    """On the test device (its backends: a GPU machine has no interpreter, so its CPU has only the reference)."""
    args = _inputs(3, 6, 8, 5, 60, seed=4, device=DEVICE)
    seed = lambda s: torch.tensor([s], device=DEVICE)  # noqa: E731
    a = dk.select_candidates(*args, 1.3, seed(7), backend=backend)
    b = dk.select_candidates(*args, 1.3, seed(7), backend=backend)
    c = dk.select_candidates(*args, 1.3, seed(8), backend=backend)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    # the uniforms are selector_uniforms of the seed: the explicit-uniform chain draws the same tokens
    u = R.selector_uniforms(torch.tensor(7), 3, 6)
    host = tuple(t.cpu() for t in args)
    assert torch.equal(R.select_chain(*host, 1.3, u)[0], a[0].cpu())
    # sequence 0 of a batch draws what the unbatched call draws
    one = dk.select_candidates(*(t[0] for t in args[:3]), *args[3:5], args[5][:1], 1.3, seed(7), backend=backend)
    assert torch.equal(one[0], a[0][0])
    # the uniforms are not the lm_head's noise words of the same seed (other Philox rows)
    assert not torch.equal(u[0], R.uniform_noise(torch.tensor(7), torch.tensor([0]), torch.arange(6))[0])


def test_sampled_slots_follow_q():
    """Chi-square: at one position, the slots sampled over many sequences (one uniform each) follow q."""
    S, k = 4000, 4
    unary = torch.tensor([[1.0, 0.2, -0.5, 0.7]]).expand(S, 1, k)
    candidates = torch.tensor([[3, 1, 4, 2]]).expand(S, 1, k)
    zeros = torch.zeros(6, 3)
    _, index, q = R.select_candidates(unary, candidates, torch.zeros(S, 1, 3), zeros, zeros,
                                      torch.zeros(S, dtype=torch.int64), 0.9, torch.tensor([11]))
    counts = torch.bincount(index[:, 0], minlength=k).double()
    expected = q[0, 0].double() * S
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 21.1, (chi2, counts.tolist(), expected.tolist())  # df = 3: p = 1e-4
    if TRITON:  # the kernel draws the same slots (first 256 sequences: the interpreter runs programs one by one)
        n = 256
        on = lambda t: t.to(DEVICE)  # noqa: E731
        got = dk.select_candidates(on(unary[:n]), on(candidates[:n]), on(torch.zeros(n, 1, 3)), on(zeros), on(zeros),
                                   on(torch.zeros(n, dtype=torch.int64)), 0.9, on(torch.tensor([11])),
                                   backend="triton")
        assert torch.equal(got[1].cpu(), index[:n])


def test_bad_inputs_are_clear_errors():
    unary, candidates, projected, pred, succ, anchor = _inputs(None, 4, 3, 5, 40)
    cases = [
        ((unary, candidates.float(), projected, pred, succ, anchor), "candidates must have int64/int32 dtype"),
        ((unary, candidates[:, :2], projected, pred, succ, anchor), "candidates must have unary's shape"),
        ((unary, candidates, projected[:, :4], pred, succ, anchor), "projected must be \\[4, 5\\]"),
        ((unary, candidates, projected, pred, succ[:, :4], anchor), "predecessor and successor must both be"),
        ((unary, candidates, projected, pred, succ, anchor.repeat(2)), "anchor must be \\[1\\]"),
        ((unary[0], candidates[0], projected[0], pred, succ, anchor), "unary must be \\[D, k\\] or \\[S, D, k\\]"),
        ((unary, candidates, projected, pred, succ, anchor, -1.0), "temperature must be a finite float >= 0"),
        ((unary, candidates, projected, pred, succ, anchor, 0.5), "needs a device seed"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            dk.select_candidates(*args)
        with pytest.raises(ValueError, match=match):
            R.select_candidates(*args)
    with pytest.raises(TypeError, match="seed tensor must be int64"):
        dk.select_candidates(unary, candidates, projected, pred, succ, anchor, 0.5, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="needs uniforms of shape \\[4\\]"):
        R.select_chain(unary, candidates, projected, pred, succ, anchor, 0.5, torch.rand(3))


def test_module_select_uses_the_op():
    """CandidateSelector.select: greedy and seeded sampling through the op on both backends, explicit
    uniforms through the reference chain; all equal select_reference of the projected states."""
    config = types.SimpleNamespace(selector_rank=5, selector_top_k=3, vocab_size=40, hidden_size=12)
    torch.manual_seed(5)
    selector = CandidateSelector(config)
    with torch.no_grad():
        for w in selector.parameters():
            w.normal_()
        hidden = torch.randn(4, 12)
        unary, candidates = torch.randn(4, 40).topk(3, dim=-1)
        anchor = torch.tensor([9])
        args = (unary, candidates, selector.hidden_projection(hidden), selector.predecessor_codebook.weight,
                selector.successor_codebook.weight, anchor)
        u = R.selector_uniforms(torch.tensor(3), 1, 4)[0]
        for backend in dk.available_backends(torch.device("cpu")):
            with force_backend(backend):
                greedy = selector.select(hidden, unary, candidates, anchor)
                sampled = selector.select(hidden, unary, candidates, anchor, 0.8, seed=torch.tensor([3]))
                explicit = selector.select(hidden, unary, candidates, anchor, 0.8, uniforms=u)
            assert torch.equal(greedy[0], select_reference(*args)[0]), backend
            assert torch.equal(sampled[0], select_reference(*args, 0.8, u)[0]), backend
            assert torch.equal(explicit[0], sampled[0]), backend
            torch.testing.assert_close(sampled[2], select_reference(*args, 0.8, u)[2], **Q_TOL)


def test_sampling_never_takes_a_zero_probability_slot():
    """A uniform of 1 (past every rounded CDF step) takes the last slot whose q is > 0, not a trailing slot whose
    probability underflowed (the kernel has the same rule; no seed reaches it in a test's time: u = 1 has
    probability 2**-25)."""
    unary = torch.tensor([[0.0, 1.0, -500.0, -600.0]])
    candidates = torch.tensor([[4, 5, 6, 7]])
    zeros = torch.zeros(8, 2)
    args = (unary, candidates, torch.zeros(1, 2), zeros, zeros, torch.tensor([0]))
    _, index, q = R.select_chain(*args, 1.0, torch.ones(1))
    assert q[0, 3] == 0 and q[0, 2] == 0 and index.tolist() == [1]
