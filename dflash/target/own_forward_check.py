"""The check that makes a silent difference impossible on a family we have never seen: our passes against the
model's own forward, once per model, before the first token.

The adapter drives a decoder's modules by hand (:mod:`dflash.target.adapter`),
so anything a family's own ``forward`` does that the family table does not
know (a decoder layer that drops the attention keywords, a norm, a window the
cache applies, an embedding scale, an extra residual) would change the text
without a word. :func:`check_own_forward` closes that class of bug: when a
target is first adapted it runs :data:`PROBE_ROWS` probe tokens through

* the model's own forward, as ``generate()`` does: the first
  :data:`PROBE_PREFILL` rows with a fresh cache, then the rest on that cache;
* our passes: the same two chunks through :meth:`TargetAdapter.forward` on our
  cache (the first attends causally from position 0, the second over the
  committed rows: the path every round pass takes), then our head;

and compares the logits row by row, ``err_r = ||ours_r - own_r|| /
||own_r||``. A row past :data:`TOLERANCE` for the model's dtype (rounding
differences between two attention paths stay far below it; a structural
difference is of the order of 1) raises
:class:`~dflash.target.families.UnsupportedTargetFeature` naming the row and
the error, and the first layer whose output differs.

The verdict is kept per (model, dtype, device) in a weak dictionary, so an
adapter opened again on the same model (every ``generate`` call opens one)
costs nothing; a refusal is kept too, and raised again. The probe costs two
forwards of the model and two of ours on :data:`PROBE_ROWS` tokens
(``bench/own_forward_check.py`` measures it).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .families import UnsupportedTargetFeature
from .patches import Patch, hold
from .wrappers import plain_forward

__all__ = ["PROBE_PREFILL", "PROBE_ROWS", "TOLERANCE", "check_own_forward", "forget", "own_probe"]

#: Probe tokens, and how many of them the first chunk holds.
PROBE_ROWS = 12
PROBE_PREFILL = 8

#: Largest relative logit error per row accepted, by the model's dtype.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 6e-2, torch.float16: 2e-2}

#: Probe rows of a half-precision MoE model allowed past the tolerance (router near-ties, see :func:`_compare`).
MOE_HALF_ROWS = 2

#: :func:`own_probe`'s answer when the model's own forward cannot run (nothing to compare with).
UNCHECKED = "unchecked"

#: model -> {(dtype, device): None (passed) or the refusal}.
_VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def forget(model) -> None:
    """Drop ``model``'s kept verdicts (after its weights or modules were changed in place)."""
    _VERDICTS.pop(model, None)


def _probe_ids(vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, max(1, vocab), (PROBE_ROWS,), generator=g).to(device)


def _cache_keyword(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _own_logits(model, decoder_layers, ids: torch.Tensor) -> Tuple[torch.Tensor, list]:
    """The model's own logits ``[PROBE_ROWS, V]`` (fp32) and each layer's output, as ``generate()`` computes
    them: a prefill with a fresh cache, then the rest of the rows on that cache."""
    layers = []
    hooks = [layer.register_forward_hook(
        lambda _m, _a, out: layers.append((out[0] if isinstance(out, (tuple, list)) else out)[0].float()))
        for layer in decoder_layers]
    try:
        first = model(ids[None, :PROBE_PREFILL], use_cache=True)
        kw = _cache_keyword(model)
        cache = first.get(kw, None) if hasattr(first, "get") else getattr(first, kw, None)
        if cache is None:  # the output names it the other way (transformers 5.17: past_key_values)
            cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
        rest = model(ids[None, PROBE_PREFILL:], use_cache=True, **{kw: cache})
    finally:
        for h in hooks:
            h.remove()
    logits = torch.cat([first.logits[0], rest.logits[0]]).float()
    n = len(hooks)
    by_layer = [torch.cat([layers[i], layers[n + i]]) for i in range(n)] if len(layers) == 2 * n else []
    return logits, by_layer


def _our_logits(adapter, ids: torch.Tensor) -> Tuple[torch.Tensor, list]:
    """Our logits ``[PROBE_ROWS, V]`` (fp32) and each layer's output: the same two chunks through our passes."""
    cache = adapter.new_cache(PROBE_ROWS)
    hidden, layers = [], []
    for s, e in ((0, PROBE_PREFILL), (PROBE_PREFILL, PROBE_ROWS)):
        h, captured = adapter.run_pass(ids[s:e], torch.arange(s, e, device=ids.device), cache, whole=True)
        cache.commit(e - s)
        hidden.append(h)
        layers.append(captured)
    logits = adapter.logits(torch.cat(hidden)).float()
    return logits, [torch.cat([a.float(), b.float()]) for a, b in zip(*layers)]


def _has_experts(adapter) -> bool:
    from .families import experts_modules

    return bool(experts_modules(adapter.model))


def _relative_errors(ours: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    return (ours - own).norm(dim=-1) / own.norm(dim=-1).clamp_min(1e-30)


def own_probe(model, decoder_layers, dtype: torch.dtype, device: torch.device, vocab: int,
              attention: Optional[str] = None, switches: Callable[[], Sequence[Patch]] = tuple):
    """The model's own side of the check, run BEFORE an adapter's patches are held (while they are, the model's
    mask functions see our attention implementation): ``(ids, logits, layer outputs)``; None when the verdict
    for this (model, dtype, device) is kept already; :data:`UNCHECKED` when the model's own forward raises (with
    a warning: there is no own output to compare with, nor a ``generate()`` to differ from).

    ``attention``: an attention implementation to run the model's own forward with instead of the one it was
    loaded with (``"eager"`` where the loaded one drops a softcap the checkpoint was trained with, which our
    passes apply). ``switches()``: patches held around the model's own forward so that both sides run the same
    implementation of what the adapter switches (the MoE experts: an experts implementation computes other last
    bits, and in half precision a router near-tie then picks other experts)."""
    if (dtype, str(device)) in _VERDICTS.get(model, {}):
        return None
    ids = _probe_ids(vocab, device)
    switch = list(switches()) + ([] if attention is None else [
        Patch(model.config, "_attn_implementation", attention, label="attention implementation of the forward check")])
    try:
        with hold(switch), _eval(model), plain_forward(model), torch.inference_mode():
            logits, layers = _own_logits(model, decoder_layers, ids)
    except Exception as exc:  # noqa: BLE001 -- the model's own forward failing is reported, not ours
        warnings.warn(f"{type(model).__name__}'s own forward raised {type(exc).__name__}: {exc}; our passes were "
                      "not compared with it", stacklevel=3)
        return UNCHECKED
    return ids, logits, layers


def check_own_forward(adapter, probe) -> None:
    """Refuse ``adapter``'s model when our passes do not compute its own forward (see the module docstring);
    ``probe``: :func:`own_probe` of the model, taken before the adapter opened."""
    model = adapter.model
    key = (adapter.dtype, str(adapter.device))
    kept: Dict = _VERDICTS.setdefault(model, {})
    if key not in kept:
        if probe is None:
            raise RuntimeError("check_own_forward needs own_probe's result for a model without a kept verdict")
        if probe is UNCHECKED:
            kept[key] = None
        else:
            with _eval(model):
                kept[key] = _compare(adapter, *probe)
    if kept[key] is not None:
        raise kept[key]


@contextlib.contextmanager
def _eval(model):
    """``model`` in eval mode (no dropout in either forward), its modules' modes restored after."""
    training = [m for m in model.modules() if m.training]
    model.eval()
    try:
        yield
    finally:
        for m in training:
            m.train()


def _compare(adapter, ids: torch.Tensor, own: torch.Tensor, own_layers: list) -> Optional[UnsupportedTargetFeature]:
    model = adapter.model
    tol = TOLERANCE.get(adapter.dtype, 6e-2)
    saved = adapter.capture_layer_ids
    with torch.inference_mode():
        adapter.capture_layer_ids = list(range(adapter.num_layers))
        try:
            ours, our_layers = _our_logits(adapter, ids)
        finally:
            adapter.capture_layer_ids = saved
            adapter._outputs = {}
    err = _relative_errors(ours, own)
    worst = int(err.argmax())
    # MoE in half precision: a router near-tie may pick other experts for a row in either pass (the attention paths
    # differ in the last bits), so up to MOE_HALF_ROWS rows may differ; a structural difference reaches more (a
    # pass over cached rows is 4 rows, a window the rows past it)
    allowed = MOE_HALF_ROWS if adapter.spec.experts is not None or _has_experts(adapter) else 0
    allowed = allowed if adapter.dtype in (torch.bfloat16, torch.float16) else 0
    bad = int((~(err <= tol)).sum())
    if not bool(torch.isfinite(err).all()) or bad > allowed:
        where = ""
        for i, (a, b) in enumerate(zip(our_layers, own_layers)):
            if float(_relative_errors(a, b).max()) > tol:
                where = f"; the first layer whose output differs: {i}"
                break
        return UnsupportedTargetFeature(
            type(model).__name__, "a forward that differs from the model's own",
            f"probe row {worst} of {PROBE_ROWS} ({'prefill' if worst < PROBE_PREFILL else 'a pass over cached rows'}):"
            f" relative logit error {float(err[worst]):.3g}, at most {tol:g} allowed in {adapter.dtype}{where}. "
            "The family does something our passes do not reproduce; it is refused rather than giving another text")
    return None
