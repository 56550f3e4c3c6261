"""The statistics the sampling tests share: transformers' processed distribution and a chi-square test."""

import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)


def hf_probs(logits, T, top_k=None, top_p=None, min_p=None):
    """transformers' processed distribution: the warpers generate() builds, in its order, then softmax."""
    warpers = LogitsProcessorList()
    if T != 1.0:
        warpers.append(TemperatureLogitsWarper(float(T)))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    scores = warpers(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.float().clone())
    return torch.softmax(scores, dim=-1)


def chi_square_pvalue(samples, probs):
    """Pearson chi-square p-value of ``samples`` against ``probs`` (cells with expectation < 5 pooled)."""
    n = samples.numel()
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * n
    assert counts[expected == 0].sum() == 0, f"samples outside the support: {(counts * (expected == 0)).nonzero()}"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.numel() < 2:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))
